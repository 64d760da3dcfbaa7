"""A LoRA base stored in 16 bits and computed in float32 (`lora.base_dtype`, `scratchlm.model.layers.upcast_linear`):
the product and its input gradient against `torch.nn.functional.linear` on the upcast weight, what autograd
keeps for the backward pass, a LoRA step's adapter gradients against those of a float32 base, the held-out loss
of a small trained model, merging, and the config key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import LoRAConfig, ModelConfig
from scratchlm.model.layers import Embedding, Linear, upcast_linear
from scratchlm.model.lora import Adapters, apply_lora, merge_lora
from scratchlm.model.transformer import TransformerLM

TINY = ModelConfig(
    vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48
)
# bfloat16 keeps 8 significant bits: rounding a weight moves it by at most 2⁻⁹ of itself.
BF16_ROUNDING = 2.0**-9


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_the_upcast_product_and_its_input_gradient_equal_functional_linear(stored):
    torch.manual_seed(0)
    weight = torch.randn(24, 40).to(stored)
    x = torch.randn(3, 7, 40, requires_grad=True)
    upstream = torch.randn(3, 7, 24)
    y = upcast_linear(x, weight)
    expected = F.linear(x, weight.float())  # exact: every 16-bit value is a float32
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1.3e-6, atol=1e-5)
    (ours,) = torch.autograd.grad(y, x, upstream)
    (theirs,) = torch.autograd.grad(expected, x, upstream)
    torch.testing.assert_close(ours, theirs, rtol=1.3e-6, atol=1e-5)
    # A frozen `Linear` whose weight is narrower than its input takes this path, and gives the same product.
    layer = Linear(40, 24)
    layer.weight.data = weight
    layer.weight.requires_grad_(False)
    torch.testing.assert_close(layer(x), expected, rtol=1.3e-6, atol=1e-5)


def saved_by(forward) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of every tensor autograd saves for the backward pass while `forward()` runs."""
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return saved


def test_the_backward_pass_keeps_the_16_bit_weight_and_no_float32_copy():
    torch.manual_seed(0)
    weight = torch.randn(24, 40).to(torch.bfloat16)
    x = torch.randn(5, 40, requires_grad=True)
    ours = saved_by(lambda: upcast_linear(x, weight))
    assert (torch.bfloat16, (24, 40)) in ours
    assert (torch.float32, (24, 40)) not in ours and (torch.float32, (40, 24)) not in ours
    # The plain way keeps the float32 copy (its transpose) alive: what the test tells apart.
    plain = saved_by(lambda: F.linear(x, weight.float()))
    assert any(dtype == torch.float32 and sorted(shape) == [24, 40] for dtype, shape in plain)


def test_a_lora_model_with_a_bf16_base_saves_no_float32_copy_of_a_frozen_weight():
    """A whole adapted model's forward and loss (the tied head, through the fused loss) on a float32 plan:
    whatever autograd saves, no float32 tensor has the shape of a frozen matrix (2 × 15 tokens: no activation
    shares one), and the matrices themselves are saved in bf16."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**TINY.to_dict(), "tie_embeddings": True}))
    apply_lora(model, Adapters(LoRAConfig(4)), base_dtype=torch.bfloat16)
    shapes = {tuple(p.shape) for p in model.parameters() if not p.requires_grad and p.dim() == 2}
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    saved = saved_by(lambda: model(ids[:, :-1], targets=ids[:, 1:]))
    float32 = {shape for dtype, shape in saved if dtype == torch.float32}
    assert not float32 & (shapes | {shape[::-1] for shape in shapes})
    assert shapes <= {shape for dtype, shape in saved if dtype == torch.bfloat16}


def adapter_gradients(model: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    """Every adapter's gradient from one loss, flattened into one vector."""
    model.zero_grad(set_to_none=True)
    model(ids[:, :-1], targets=ids[:, 1:]).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def adapted_copies(seed: int = 0) -> dict[str, TransformerLM]:
    """One adapted model three ways: its base in float32, stored in bf16, and in float32 with every frozen
    matrix rounded to bf16 beforehand (the oracle of the bf16 one); the same adapters, B non-zero so that A
    has a gradient too."""
    torch.manual_seed(seed)
    reference = TransformerLM(TINY)
    models = {}
    for name in ("fp32", "bf16", "rounded"):
        model = TransformerLM(TINY)
        model.load_state_dict(reference.state_dict())
        if name == "rounded":
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.copy_(p.to(torch.bfloat16).float())
        torch.manual_seed(seed + 1)  # the same A in each
        apply_lora(model, Adapters(LoRAConfig(4)), base_dtype=torch.bfloat16 if name == "bf16" else None)
        torch.manual_seed(seed + 2)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "lora_B"):
                    m.lora_B.normal_(std=0.05)
        models[name] = model
    return models


def test_adapter_gradients_of_a_bf16_base_are_those_of_its_rounded_weights_and_near_float32():
    models = adapted_copies()
    ids = torch.randint(0, TINY.vocab_size, (4, 17))
    grads = {name: adapter_gradients(model, ids) for name, model in models.items()}
    # Stored in bf16 and computed in float32 is the float32 model of the rounded weights, to float32 rounding.
    torch.testing.assert_close(grads["bf16"], grads["rounded"], rtol=1e-5, atol=1e-6)
    # Against the unrounded base: each weight moved by at most 2⁻⁹ of itself; through the two blocks, the
    # head and the embeddings the gradient moves by a few times that, relative to its size.
    relative = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert 0 < relative < 8 * BF16_ROUNDING


def progressions(count: int, steps: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """`count` sequences of 17 tokens, `x_{t+1} = x_t + d mod 64` with `d` drawn from `steps`: the model must
    read `d` off the sequence to predict it."""
    start = torch.randint(0, 64, (count, 1), generator=generator)
    step = torch.tensor(steps)[torch.randint(0, len(steps), (count, 1), generator=generator)]
    return (start + step * torch.arange(17)) % 64


def train(model: TransformerLM, steps: tuple[int, ...], iterations: int, lr: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(iterations):
        ids = progressions(32, steps, generator)
        model(ids[:, :-1], targets=ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def held_out_loss(model: TransformerLM, steps: tuple[int, ...]) -> float:
    ids = progressions(256, steps, torch.Generator().manual_seed(99))
    return model(ids[:, :-1], targets=ids[:, 1:]).item()


def test_a_small_trained_model_fine_tuned_on_a_bf16_base_reaches_the_float32_bases_held_out_loss():
    """Pretrain a small model on progressions of steps 1-3, then fine-tune LoRA adapters to steps 5 and 7,
    its base once in float32 and once stored in bf16 (float32 compute both): the held-out losses agree within
    0.01 nats, and both fine-tunings learned (the base alone is far worse on the new steps)."""
    torch.manual_seed(0)
    base = TransformerLM(TINY)
    train(base, (1, 2, 3), 150, 3e-3, seed=0)
    losses, before = {}, None
    for stored in (None, torch.bfloat16):
        model = TransformerLM(TINY)
        model.load_state_dict(base.state_dict())
        torch.manual_seed(1)
        apply_lora(model, Adapters(LoRAConfig(8)), base_dtype=stored)
        before = held_out_loss(model, (5, 7))
        train(model, (5, 7), 60, 1e-2, seed=1)
        losses[stored] = held_out_loss(model, (5, 7))
    assert abs(losses[None] - losses[torch.bfloat16]) < 0.01
    assert losses[None] < before - 0.5


def test_merging_a_bf16_base_gives_back_float32_weights_with_the_whole_update():
    models = adapted_copies()
    ours, rounded = models["bf16"], models["rounded"]
    q = ours.layers[0].attn.q_proj
    expected = q.weight.float() + 2.0 * q.lora_B @ q.lora_A  # α = 2r: a scaling of 2
    merge_lora(ours)
    merge_lora(rounded)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert ours.token_embeddings.compute_dtype is None
    torch.testing.assert_close(q.weight, expected, rtol=0, atol=0)
    # The update is not rounded to bf16: the merged weight differs from the rounded base by B A itself.
    assert not torch.equal(q.weight, q.weight.to(torch.bfloat16).float())
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), rounded(ids), rtol=1e-5, atol=1e-5)


def test_embeddings_stored_in_bf16_return_float32_rows():
    model = TransformerLM(TINY)
    table = model.token_embeddings.weight.detach().clone()
    apply_lora(model, Adapters(LoRAConfig(4)), base_dtype=torch.bfloat16)
    embeddings: Embedding = model.token_embeddings
    ids = torch.tensor([[3, 5, 60]])
    rows = embeddings(ids)
    assert embeddings.weight.dtype == torch.bfloat16 and rows.dtype == torch.float32
    assert torch.equal(rows, table[ids].to(torch.bfloat16).float())


def test_the_config_key_takes_its_names_and_older_records_load():
    from scratchlm.training.config import TrainConfig

    stage = ["data.train='a.npy'", "data.valid='b.npy'", "training.max_steps=1"]
    with pytest.raises(ScratchlmError, match="lora.base_dtype must be one of 'auto', 'bf16', 'fp16', 'fp32'"):
        TrainConfig.load(None, [*stage, "lora.base_dtype='int4'"])
    with pytest.raises(ScratchlmError, match="lora.base_dtype must be one of"):
        LoRAConfig(4, base_dtype="bfloat16").check("test")  # type: ignore[arg-type]
    assert LoRAConfig(4, base_dtype="fp32").base_precision("bf16") == "fp32"
    assert [LoRAConfig(4).base_precision(p) for p in ("fp32", "bf16", "fp16")] == ["bf16", "bf16", "fp16"]
    # A record written before the key existed reads as "auto"; a new one keeps it.
    old = {"rank": 4, "alpha": 8.0, "targets": ["q_proj"], "base": "b", "base_fingerprint": "f"}
    assert Adapters.from_dict(old).config.base_dtype == "auto"
    new = Adapters(LoRAConfig(4, base_dtype="fp32"), "b", "f").to_dict()
    assert Adapters.from_dict(new).config.base_dtype == "fp32"
