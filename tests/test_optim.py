"""AdamW against torch.optim.AdamW; the SGD toy example of the CS336 assignment-1 handout."""

import math

import pytest
import torch

from scratchlm import SGD, AdamW
from scratchlm.errors import ScratchlmError


def train_toy(optimizer_class, steps: int, **hyper) -> torch.Tensor:
    """A small regression network trained on fixed random data; returns its flattened final parameters."""
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 5, generator=g), torch.randn(32, 2, generator=g)
    optimizer = optimizer_class(model.parameters(), **hyper)
    for _ in range(steps):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_adamw_matches_torch_after_1000_steps():
    # The specification's criterion, with the default hyperparameters. (With a larger learning rate the two
    # drift apart slowly: torch applies the weight decay before the Adam step and scales ε by sqrt(1 - β2^t),
    # the specification after it and unscaled; the test below checks our rule exactly for other settings.)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ours = train_toy(AdamW, 1000, **hyper)
    theirs = train_toy(torch.optim.AdamW, 1000, **hyper)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # and the problem is not trivial: the parameters moved
    assert (ours - train_toy(AdamW, 0, **hyper)).abs().max() > 0.1


def test_adamw_matches_the_update_rule_written_out_per_element():
    lr, (beta1, beta2), eps, wd = 3e-3, (0.8, 0.95), 1e-6, 0.2
    g = torch.Generator().manual_seed(5)
    start = [
        torch.randn(3, 4, generator=g, dtype=torch.float64),
        torch.randn(6, generator=g, dtype=torch.float64),
    ]
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in start] for _ in range(50)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    optimizer = AdamW(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    for step_grads in grads:
        for p, grad in zip(params, step_grads, strict=True):
            p.grad = grad.clone()
        optimizer.step()
    for i, p0 in enumerate(start):
        for index in range(p0.numel()):
            theta, m, v = p0.flatten()[index].item(), 0.0, 0.0
            for t, step_grads in enumerate(grads, start=1):
                grad = step_grads[i].flatten()[index].item()
                m = beta1 * m + (1 - beta1) * grad
                v = beta2 * v + (1 - beta2) * grad**2
                alpha_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                theta -= alpha_t * m / (math.sqrt(v) + eps)
                theta -= lr * wd * theta
            assert params[i].detach().flatten()[index].item() == pytest.approx(theta, rel=1e-12, abs=1e-12)


def test_adamw_first_step_by_hand():
    # Step 1: m = 0.1 g, v = 0.001 g², α_1 = α sqrt(0.001) / 0.1, so θ moves by α·g/(|g| + ε/sqrt(0.001))·...
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    p.grad = torch.tensor([0.5, -4.0])
    lr, wd, eps = 0.1, 0.5, 1e-8
    AdamW([p], lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=wd).step()
    g = torch.tensor([0.5, -4.0])
    m, v = 0.1 * g, 0.001 * g**2
    alpha_t = lr * math.sqrt(1 - 0.999) / (1 - 0.9)
    theta = torch.tensor([1.0, -2.0]) - alpha_t * m / (v.sqrt() + eps)
    theta = theta - lr * wd * theta
    torch.testing.assert_close(p.detach(), theta)


def test_adamw_state_dict_round_trip_continues_identically():
    def run(split: bool) -> torch.Tensor:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 3))
        opt = AdamW([w], lr=1e-2)
        for i in range(10):
            if split and i == 5:
                state = opt.state_dict()
                opt = AdamW([w], lr=1e-2)
                opt.load_state_dict(state)
            opt.zero_grad()
            (w.sin() ** 2).sum().backward()
            opt.step()
        return w.detach()

    assert torch.equal(run(False), run(True))


def test_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ScratchlmError, match="lr"):
        AdamW(p, lr=-1.0)
    with pytest.raises(ScratchlmError, match="betas"):
        AdamW(p, betas=(0.9, 1.0))


def sgd_toy(lr: float) -> list[float]:
    """The handout's example: minimise mean(θ²) for a 10×10 θ for 10 steps; returns the losses."""
    torch.manual_seed(0)
    weights = torch.nn.Parameter(5 * torch.randn((10, 10)))
    optimizer = SGD([weights], lr=lr)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss = (weights**2).mean()
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
    return losses


def test_sgd_update_rule_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = SGD([p], lr=0.5)
    for t in range(3):
        p.grad = torch.tensor([2.0])
        before = p.item()
        opt.step()
        assert p.item() == pytest.approx(before - 0.5 / math.sqrt(t + 1) * 2.0)


def test_sgd_toy_example_behaviour():
    # The gradient of mean(θ²) is θ/50, so each step multiplies θ by (1 - lr/(50 sqrt(t+1))).
    small, medium, large = sgd_toy(1e1), sgd_toy(1e2), sgd_toy(1e3)
    assert all(b < a for a, b in zip(small, small[1:], strict=False))  # lr 10: steady decrease
    assert small[-1] > 0.1 * small[0]
    assert medium[-1] < 1e-10 * medium[0]  # lr 100: collapses (the factors are -1, -0.41, -0.15, 0)
    assert large[-1] > 1e10 * large[0]  # lr 1000: diverges


def _groups_by_name(model: torch.nn.Module) -> dict[str, list[str]]:
    """An independent rule, by the parameters' names: what each role means for the model's layout."""
    groups: dict[str, list[str]] = {"matrices": [], "embeddings": [], "head": [], "gains": [], "adapters": []}
    for name, param in model.named_parameters():
        if name == "token_embeddings.weight" or name.startswith("value_embeddings."):
            groups["embeddings"].append(name)
        elif name.endswith((".lora_A", ".lora_B")):
            groups["adapters"].append(name)
        elif name == "lm_head.weight":
            groups["head"].append(name)
        elif name.endswith("norm.weight") or name.startswith(("ln_final.", "skip_weights")) or ".ln" in name:
            groups["gains"].append(name)
        else:
            assert name.startswith("layers.") and param.dim() == 2, name
            groups["matrices"].append(name)
    return groups


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_embeddings": True},
        {"value_embeddings": 1, "unet_skips": True, "qk_norm": True, "ffn": "relu2"},
        {"norm": "post", "ffn": "silu"},
        {"norm": "none", "num_kv_heads": 1},
    ],
)
def test_the_model_declares_its_parameter_groups(changes):
    from scratchlm import ModelConfig, TransformerLM, parameter_groups

    config = ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, **changes)
    model = TransformerLM.from_config(config)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = {role: [names[id(p)] for p in params] for role, params in parameter_groups(model).items()}
    assert groups == _groups_by_name(model)  # in the order of named_parameters, as optimizer states are saved


def test_parameter_groups_that_miss_or_repeat_a_parameter_are_refused():
    from scratchlm import ModelConfig, TransformerLM, parameter_groups

    model = TransformerLM.from_config(
        ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2)
    )
    declared = TransformerLM.parameter_groups(model)
    model.parameter_groups = lambda: {**declared, "gains": declared["gains"][1:]}
    with pytest.raises(ValueError, match=r"missing layers\.0\.ln1\.weight"):
        parameter_groups(model)
    model.parameter_groups = lambda: {**declared, "head": declared["head"] + declared["embeddings"]}
    with pytest.raises(ValueError, match="is in groups embeddings and head|is in groups head and embeddings"):
        parameter_groups(model)
