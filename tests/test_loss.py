"""cross_entropy, and the fused LM head and loss, against torch.nn.functional.cross_entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm import cross_entropy
from scratchlm.errors import ScratchlmError
from scratchlm.model.loss import fused_linear_cross_entropy


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


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
def test_fused_head_and_loss_equal_the_unfused_path(softcap, chunk_size):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 16, generator=generator, requires_grad=True)
    weight = (torch.randn(50, 16, generator=generator) * 0.5).requires_grad_()
    targets = torch.randint(0, 50, (3, 10), generator=generator)
    loss = fused_linear_cross_entropy(hidden, weight, targets, softcap, chunk_size)
    grads = torch.autograd.grad(loss, [hidden, weight])
    logits = hidden @ weight.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    for grad, grad_expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, grad_expected, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "logit_softcap": 3.0}])
def test_model_loss_with_targets_equals_loss_of_its_logits(changes):
    from scratchlm import ModelConfig, TransformerLM

    config = ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, **changes)
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    tokens = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    for grad, grad_expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, grad_expected, atol=1e-6, rtol=1e-4)


def test_fused_loss_under_bf16_autocast_matches_the_unfused_path():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 32, generator=generator, requires_grad=True)
    weight = (torch.randn(300, 32, generator=generator) * 0.2).requires_grad_()
    targets = torch.randint(0, 300, (40,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, targets, 0.0, 16)
        expected = cross_entropy(hidden @ weight.T, targets)
    grads = torch.autograd.grad(loss, [hidden, weight])
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    for grad, grad_expected in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, grad_expected, atol=1e-3, rtol=2e-2)


def test_fused_loss_rejects_bad_chunks_and_shapes():
    hidden, weight = torch.zeros(4, 8), torch.zeros(10, 8)
    with pytest.raises(ScratchlmError, match="chunk_size of at least 1, got 0"):
        fused_linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), chunk_size=0)
    with pytest.raises(ScratchlmError, match=r"hidden \(4, 8\) and targets \(5,\)"):
        fused_linear_cross_entropy(hidden, weight, torch.zeros(5, dtype=torch.long))
