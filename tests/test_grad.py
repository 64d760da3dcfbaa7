"""clip_grad_norm against torch.nn.utils.clip_grad_norm_."""

import pytest
import torch

from scratchlm import clip_grad_norm


def make_params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(5, 3), (7,), (2, 2, 4)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize("scale, max_norm", [(10.0, 1.0), (0.01, 1.0), (1.0, 0.5)])
def test_matches_torch(scale, max_norm):
    ours, theirs = make_params(0, scale), make_params(0, scale)
    total = clip_grad_norm(ours, max_norm)
    expected_total = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(total, expected_total)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_clipped_norm_is_the_maximum():
    params = make_params(1, 100.0)
    clip_grad_norm(params, 2.0)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert norm.item() == pytest.approx(2.0, rel=1e-5)


def test_small_gradients_are_left_bit_for_bit():
    params = make_params(2, 1e-3)
    before = [p.grad.clone() for p in params]
    clip_grad_norm(params, 1.0)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.grad, b)


def test_parameters_without_gradients_are_skipped():
    ours, theirs = make_params(3, 5.0), make_params(3, 5.0)
    frozen = torch.nn.Parameter(torch.ones(4))
    total = clip_grad_norm([*ours, frozen], 1.0)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert frozen.grad is None
