"""cross_entropy against torch.nn.functional.cross_entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm import cross_entropy


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_matches_torch_on_ordinary_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5, generator=g)
    targets = torch.randint(0, 5, (8,), generator=g)
    torch.testing.assert_close(cross_entropy(logits, targets), reference(logits, targets))


def test_extra_batch_dimensions_average_over_all_of_them():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, 11, generator=g)
    targets = torch.randint(0, 11, (2, 3, 4), generator=g)
    loss = cross_entropy(logits, targets)
    assert loss.shape == ()
    torch.testing.assert_close(loss, reference(logits, targets))


def test_large_logits_stay_finite():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 7, generator=g) * 1e4 + 1e5
    targets = torch.randint(0, 7, (6,), generator=g)
    loss = cross_entropy(logits, targets)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, reference(logits, targets))


def test_a_target_with_vanishing_probability_has_a_finite_large_loss():
    logits = torch.tensor([[0.0, 1000.0]])
    assert cross_entropy(logits, torch.tensor([0])).item() == pytest.approx(1000.0)
    assert cross_entropy(logits, torch.tensor([1])).item() == pytest.approx(0.0)


def test_uniform_logits_give_log_vocab():
    logits = torch.zeros(3, 4, 50)
    targets = torch.randint(0, 50, (3, 4))
    assert cross_entropy(logits, targets).item() == pytest.approx(math.log(50), rel=1e-6)


def test_bfloat16_logits_are_accumulated_in_float32():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 10_000, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 10_000, (16,), generator=g)
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference(logits, targets))


def test_gradient_matches_torch():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(4, 9, 13, generator=g)
    targets = torch.randint(0, 13, (4, 9), generator=g)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    # Scaled, as the trainer scales each micro-batch's loss by 1 / grad_accum.
    (cross_entropy(ours, targets) / 3).backward()
    (reference(theirs, targets) / 3).backward()
    torch.testing.assert_close(ours.grad, theirs.grad)


def test_gradient_of_bfloat16_logits_is_bfloat16_and_computed_in_float32():
    g = torch.Generator().manual_seed(5)
    base = (torch.randn(32, 1000, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (32,), generator=g)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    cross_entropy(ours, targets).backward()
    reference(theirs, targets).backward()
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad, theirs.grad)
