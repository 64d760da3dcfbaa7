"""cosine_lr_schedule against values computed by hand from the formula of the CS336 assignment-1 handout."""

import math

import pytest

from scratchlm import cosine_lr_schedule


def test_specification_values():
    # (α_max, α_min, T_w, T_c) = (1, 0.1, 7, 21): warm-up t/7 for t < 7, then
    # 0.1 + 0.45 (1 + cos((t - 7)/14 π)) up to t = 21, then 0.1.
    expected = [
        0.0,
        0.14285714285714285,
        0.2857142857142857,
        0.42857142857142855,
        0.5714285714285714,
        0.7142857142857143,
        0.8571428571428571,
        1.0,
        0.9887175604818206,
        0.9554359905560885,
        0.9018241671106134,
        0.8305704108364301,
        0.7452476826029011,
        0.6501344202803414,
        0.55,
        0.44986557971965857,
        0.3547523173970989,
        0.26942958916356996,
        0.19817583288938662,
        0.14456400944391146,
        0.11128243951817937,
        0.1,
        0.1,
        0.1,
        0.1,
    ]
    got = [cosine_lr_schedule(t, 1.0, 0.1, 7, 21) for t in range(25)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_hand_computed_landmarks():
    assert cosine_lr_schedule(8, 1.0, 0.1, 7, 21) == pytest.approx(0.988718, abs=1e-6)
    assert cosine_lr_schedule(14, 1.0, 0.1, 7, 21) == pytest.approx(0.55)
    # a quarter of the way down the cosine: 0.1 + 0.45 (1 + cos(π/4))
    assert cosine_lr_schedule(10, 1.0, 0.1, 6, 22) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))


def test_no_warmup_starts_at_the_peak():
    assert cosine_lr_schedule(0, 3e-4, 3e-5, 0, 100) == 3e-4
    assert cosine_lr_schedule(100, 3e-4, 3e-5, 0, 100) == pytest.approx(3e-5)
