"""Muon + AdamW (scratchlm.training.muon) against the update written here from its definition, the
Newton–Schulz iteration against an SVD, and the parameter groups `build_optimizer` makes for it."""

import io

import pytest
import torch

from scratchlm import ModelConfig, TransformerLM
from scratchlm.errors import ScratchlmError
from scratchlm.training.muon import NEWTON_SCHULZ_COEFFICIENTS, Muon, newton_schulz
from scratchlm.training.optimizers import OptimizerConfig, build_optimizer

TINY = ModelConfig(vocab_size=53, context_length=8, d_model=16, num_layers=2, num_heads=2, ffn="relu2")


def quintic(sigma: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    for _ in range(steps):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


@pytest.mark.parametrize("shape", [(12, 12), (8, 20), (20, 8)])
def test_newton_schulz_maps_each_singular_value_through_the_polynomial(shape):
    """In float64 the iteration equals `U p(Σ / ||G||_F) Vᵀ` from an SVD, p the quintic applied 5 times."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    expected = U @ torch.diag(quintic(S / torch.linalg.norm(G), 5)) @ Vh
    torch.testing.assert_close(newton_schulz(G, 5, torch.float64), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 64, 96)])
def test_the_orthogonalised_update_has_singular_values_near_one(shape, dtype):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    update = newton_schulz(G, 5, dtype)
    assert update.dtype == G.dtype and update.shape == G.shape
    singular_values = torch.linalg.svdvals(update)
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25
    # and its singular vectors are G's: Uᵀ O V is diagonal, with those singular values on the diagonal
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    D = U.mT @ update @ Vh.mT
    diagonal = torch.diagonal(D, dim1=-2, dim2=-1)
    assert (D - torch.diag_embed(diagonal)).abs().max() < 0.03
    assert diagonal.min() > 0.6


def reference_step(params, grads, state, algorithm, rate, hp, t):
    """One step of the optimizer written from its definition, a parameter at a time: Muon (momentum,
    optional Nesterov, Newton–Schulz, shape scale, decoupled decay) for matrices, AdamW (bias-corrected step
    size, decoupled decay) for the rest."""
    for name, p in params.items():
        g, lr = grads[name], rate[name]
        if algorithm[name] == "muon":
            mu = hp["momentum"]
            B = state.setdefault(name, torch.zeros_like(p))
            B.mul_(mu).add_((1 - mu) * g)
            M = (1 - mu) * g + mu * B if hp["nesterov"] else B
            update = newton_schulz(M, 5, torch.float32)
            rows, cols = p.shape
            p.mul_(1 - lr * hp["muon_wd"]).sub_(lr * max(1, rows / cols) ** 0.5 * update)
        else:
            (b1, b2), eps, wd = hp["betas"], hp["eps"], hp["wd"]
            m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            p.sub_(lr * (1 - b2**t) ** 0.5 / (1 - b1**t) * m / (v.sqrt() + eps))
            p.mul_(1 - lr * wd)


def test_build_optimizer_gives_matrices_to_muon_and_the_rest_to_adamw():
    model = TransformerLM.from_config(TINY)
    config = OptimizerConfig(name="muon", lr=0.01, muon_lr=0.05, embedding_lr=0.2, head_lr=0.004)
    optimizer = build_optimizer(config, model)
    assert isinstance(optimizer, Muon)
    by_name = {g["name"]: g for g in optimizer.param_groups}
    assert {n: g["algorithm"] for n, g in by_name.items()} == {
        "matrices": "muon", "embeddings": "adamw", "head": "adamw", "gains": "adamw"
    }  # fmt: skip
    assert {n: g["lr_scale"] * config.lr for n, g in by_name.items()} == pytest.approx(
        {"matrices": 0.05, "embeddings": 0.2, "head": 0.004, "gains": 0.01}
    )
    assert all(p.dim() == 2 for p in by_name["matrices"]["params"])
    assert len(by_name["matrices"]["params"]) == TINY.num_layers * 6  # q, k, v, o, w1, w2
    assert by_name["matrices"]["weight_decay"] == config.muon_weight_decay
    assert by_name["gains"]["weight_decay"] == config.weight_decay


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_and_adamw_steps_equal_the_definition(nesterov):
    torch.manual_seed(0)
    model = TransformerLM.from_config(TINY)
    config = OptimizerConfig(
        name="muon", lr=0.01, muon_lr=0.05, embedding_lr=0.2, head_lr=0.004, weight_decay=0.1,
        muon_weight_decay=0.05, muon_nesterov=nesterov, betas=(0.8, 0.95), eps=1e-8,
        muon_bf16=False,  # the oracle iterates in float32
    )  # fmt: skip
    optimizer = build_optimizer(config, model)
    assert optimizer.ns_dtype == torch.float32
    for group in optimizer.param_groups:
        group["lr"] = config.lr * group["lr_scale"]

    names = {p: n for n, p in model.named_parameters()}
    algorithm = {names[p]: g["algorithm"] for g in optimizer.param_groups for p in g["params"]}
    # the rates as configured, not as the optimizer computed them
    rate = {n: {"matrices": 0.05, "embeddings": 0.2, "head": 0.004, "gains": 0.01}[
        "embeddings" if "token_embeddings" in n else "head" if "lm_head" in n
        else "gains" if p.dim() == 1 else "matrices"] for n, p in model.named_parameters()}  # fmt: skip
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    hp = {
        "momentum": 0.95,
        "nesterov": nesterov,
        "muon_wd": 0.05,
        "betas": (0.8, 0.95),
        "eps": 1e-8,
        "wd": 0.1,
    }
    state: dict = {}
    generator = torch.Generator().manual_seed(1)
    for t in range(1, 4):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        optimizer.step()
        reference_step(reference, grads, state, algorithm, rate, hp, t)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), reference[n], atol=1e-6, rtol=1e-5, msg=n)


def test_state_dict_round_trip_continues_exactly():
    torch.manual_seed(0)
    model = TransformerLM.from_config(TINY)
    config = OptimizerConfig(name="muon", lr=0.01)
    optimizer = build_optimizer(config, model)
    generator = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=generator) for p in model.parameters()] for _ in range(4)]

    def steps(m, opt, batch):
        for gs in batch:
            for p, g in zip(m.parameters(), gs, strict=True):
                p.grad = g.clone()
            opt.step()

    steps(model, optimizer, grads[:2])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    restored = TransformerLM.from_config(TINY)
    restored.load_state_dict(saved["model"])
    restored_optimizer = build_optimizer(config, restored)
    restored_optimizer.load_state_dict(saved["optimizer"])
    steps(model, optimizer, grads[2:])
    steps(restored, restored_optimizer, grads[2:])
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_muon_step_lowers_the_loss_of_a_least_squares_problem():
    """Orthogonalised steps descend: W x ≈ y for a random linear map, Muon alone, 30 steps."""
    generator = torch.Generator().manual_seed(4)
    target, inputs = torch.randn(8, 16, generator=generator), torch.randn(16, 64, generator=generator)
    W = torch.nn.Parameter(torch.zeros(8, 16))
    optimizer = Muon([W], lr=0.2)
    losses = []
    for _ in range(30):
        loss = ((W @ inputs - target @ inputs) ** 2).mean()
        losses.append(loss.item())
        W.grad = torch.autograd.grad(loss, W)[0]
        optimizer.step()
    assert losses[-1] < 0.1 * losses[0] and losses == sorted(losses, reverse=True)


def test_misuse_is_a_clear_error():
    with pytest.raises(ScratchlmError, match="not 2-D"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ScratchlmError, match="algorithm must be one of"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "algorithm": "lion"}])
    with pytest.raises(ScratchlmError, match="momentum"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], momentum=1.0)
