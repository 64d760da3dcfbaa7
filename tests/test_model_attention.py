"""`model.attention`: the whole model with the Triton kernel ("triton", run by Triton's interpreter without a
CUDA device) computes what it computes with the blocked tensor implementation ("torch"): logits, every
parameter's gradient, grouped-query attention, generation with a KV cache, torch.compile. And the setting's
checks, defaults and persistence."""

import dataclasses

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("triton is not installed", allow_module_level=True)

from helpers import assert_same_gradients

import scratchlm.kernels.flash as kernel_module
from scratchlm import ModelConfig, TransformerLM
from scratchlm.errors import ScratchlmError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# d_model / num_heads = 16, the kernel's smallest head.
TINY = ModelConfig(vocab_size=61, context_length=40, d_model=64, num_layers=2, num_heads=4, d_ff=96)


def pair(**changes) -> tuple[TransformerLM, TransformerLM]:
    """The same weights, attention by the kernel and by tensor operations."""
    torch.manual_seed(0)
    kernel = TransformerLM.from_config(dataclasses.replace(TINY, attention="triton", **changes)).to(DEVICE)
    blocked = TransformerLM.from_config(dataclasses.replace(TINY, attention="torch", **changes)).to(DEVICE)
    blocked.load_state_dict(kernel.state_dict())
    return kernel, blocked


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 2}, {"num_kv_heads": 1, "qk_norm": True}])
def test_logits_and_gradients_equal_the_tensor_implementation(changes):
    kernel, blocked = pair(**changes)
    tokens = ids(2, 37)
    logits, expected = kernel(tokens), blocked(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    logits.square().mean().backward()
    expected.square().mean().backward()
    assert_same_gradients(kernel, blocked, atol=1e-6, rtol=1e-4)


def test_generation_with_a_kv_cache_uses_the_kernel_and_equals_the_full_forward():
    kernel, blocked = pair(num_kv_heads=2)
    tokens = ids(2, 12)
    cache = kernel.new_kv_cache(batch_size=2)
    with torch.no_grad():
        pieces = [kernel(tokens[:, :5], kv_cache=cache)]  # prefill: 5 queries against 5 keys
        pieces += [kernel(tokens[:, t : t + 1], kv_cache=cache) for t in range(5, 12)]  # 1 query, t + 1 keys
        torch.testing.assert_close(torch.cat(pieces, dim=1), blocked(tokens), atol=1e-5, rtol=1e-5)


def test_compiles_without_graph_breaks():
    kernel, blocked = pair()
    # aot_eager traces what inductor does (one graph, fake outputs, the backward op) without its C++ build.
    compiled = torch.compile(kernel, fullgraph=True, backend="aot_eager")
    tokens = ids(2, 21)
    logits = compiled(tokens)
    torch.testing.assert_close(logits, blocked(tokens), atol=1e-5, rtol=1e-5)
    logits.square().mean().backward()
    blocked(tokens).square().mean().backward()
    torch.testing.assert_close(kernel.lm_head.weight.grad, blocked.lm_head.weight.grad, atol=1e-6, rtol=1e-4)
    first = kernel.layers[0].attn.q_proj.weight.grad
    torch.testing.assert_close(first, blocked.layers[0].attn.q_proj.weight.grad, atol=1e-6, rtol=1e-4)


def test_auto_takes_the_tensor_implementation_on_the_cpu():
    model = TransformerLM.from_config(TINY)
    assert model.config.attention == "auto"
    attn = model.layers[0].attn
    assert not attn._uses_kernel(torch.zeros(1, 4, 3, 16))
    assert attn._uses_kernel(torch.zeros(1, 4, 3, 16, device="meta")) is False
    triton_model = TransformerLM.from_config(dataclasses.replace(TINY, attention="triton"))
    assert triton_model.layers[0].attn._uses_kernel(torch.zeros(1, 4, 3, 16))


def test_triton_on_the_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernel_module, "INTERPRETED", False)
    model = TransformerLM.from_config(dataclasses.replace(TINY, attention="triton"))
    with pytest.raises(ScratchlmError, match="runs on a CUDA device .*got tensors on cpu"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_the_setting_is_checked_and_kept_only_when_not_auto():
    with pytest.raises(
        ScratchlmError, match="model.attention must be one of auto, triton, torch; got 'flash'"
    ):
        ModelConfig(attention="flash")
    assert "attention" not in TINY.to_dict()  # configs written before the setting read and write as before
    chosen = dataclasses.replace(TINY, attention="torch")
    assert chosen.to_dict()["attention"] == "torch"
    assert ModelConfig.from_dict(chosen.to_dict()) == chosen
    assert ModelConfig.from_dict(TINY.to_dict()).attention == "auto"
    # The state dict does not depend on it.
    kernel, blocked = pair()
    assert list(kernel.state_dict()) == list(blocked.state_dict())
