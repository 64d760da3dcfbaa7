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


def test_the_linear_schedule_by_hand():
    """(α_max, α_min, T_w, T_c) = (1, 0.1, 4, 10): t/4 during the warm-up, then 1 - 0.9 (t - 4)/6 down to 0.1 at
    t = 10, then 0.1."""
    from scratchlm.training.schedule import linear_lr_schedule

    expected = [0.0, 0.25, 0.5, 0.75, 1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1, 0.1]
    got = [linear_lr_schedule(t, 1.0, 0.1, 4, 10) for t in range(12)]
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["cosine", "wsd", "linear"])
def test_every_registered_schedule_is_a_config_kind_and_ends_at_min_lr(kind):
    """A kind in the registry is accepted by the config and built by `build_schedule`; each warms up
    linearly, starts its decay from the peak and ends at `min_lr` on the schedule's last step."""
    from scratchlm.training.config import TrainConfig
    from scratchlm.training.schedule import SCHEDULES, build_schedule

    assert kind in SCHEDULES
    config = TrainConfig.from_dict(
        {"data": {"train": "t.npy", "valid": "v.npy"}, "schedule": {"kind": kind, "warmup_iters": 5},
         "training": {"max_steps": 50}}
    )  # fmt: skip
    schedule = build_schedule(config.schedule, 1.0, 0.1, 50)
    assert [schedule(t) for t in range(6)] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert schedule(50) == pytest.approx(0.1) and schedule(60) == pytest.approx(0.1)
    assert all(schedule(t) >= schedule(t + 1) for t in range(5, 60))


def test_the_time_budget_asks_the_schedule_which_share_decays():
    """What a budget may still move: the WSD's decay fraction; every step after the warm-up for the others."""
    from scratchlm.training.schedule import ScheduleConfig

    assert ScheduleConfig(kind="wsd", decay_fraction=0.3).decaying_share == 0.3
    assert ScheduleConfig(kind="cosine").decaying_share == ScheduleConfig(kind="linear").decaying_share == 1.0
