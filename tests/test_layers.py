"""Each building block against the PyTorch built-in it replaces, or against its formula written out here."""

import math

import pytest
import torch
import torch.nn.functional as F
from reference_lm import complex_rope

from scratchlm import (
    Embedding,
    Linear,
    MultiHeadSelfAttention,
    RMSNorm,
    RotaryPositionalEmbedding,
    SwiGLU,
    causal_attention,
    scaled_dot_product_attention,
    silu,
    softmax,
)
from scratchlm.errors import ScratchlmError
from scratchlm.model.ffn import SiLUFeedForward


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_linear_is_x_times_w_transposed_with_extra_batch_dims():
    layer = Linear(6, 4)
    assert layer.weight.shape == (4, 6) and list(dict(layer.named_parameters())) == ["weight"]
    x = torch.randn(2, 3, 5, 6, generator=gen(0))
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_linear_init_is_truncated_normal_with_glorot_variance():
    torch.manual_seed(0)
    layer = Linear(300, 500)
    std = math.sqrt(2 / 800)
    w = layer.weight.detach()
    assert w.abs().max() <= 3 * std + 1e-7
    # A normal truncated at ±3σ has std 0.9866σ.
    assert abs(w.std().item() / std - 0.9866) < 0.01
    assert abs(w.mean().item()) < 0.01 * std


def test_embedding_is_a_row_lookup_and_init_is_truncated_standard_normal():
    torch.manual_seed(0)
    emb = Embedding(1000, 64)
    ids = torch.randint(0, 1000, (3, 7), generator=gen(1))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    w = emb.weight.detach()
    assert w.abs().max() <= 3.0 and abs(w.std().item() - 0.9866) < 0.01


def test_device_and_dtype_are_honoured():
    for module in (
        Linear(4, 3, dtype=torch.float64),
        Embedding(5, 4, dtype=torch.float64),
        RMSNorm(4, dtype=torch.float64),
    ):
        assert module.weight.dtype == torch.float64 and module.weight.device.type == "cpu"
    assert SwiGLU(4, 8, device="meta").w1.weight.device.type == "meta"


def test_rmsnorm_matches_formula_and_torch():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=gen(2)))
    x = torch.randn(2, 3, 8, generator=gen(3))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, eps=1e-5))


def test_rmsnorm_computes_in_float32_and_returns_input_dtype():
    norm = RMSNorm(256)
    x = (torch.randn(4, 256, generator=gen(4)) * 30).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    exact = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    # Only the final rounding to bfloat16 is allowed: half a bfloat16 ulp.
    torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=0, atol=0)


def test_silu_matches_torch():
    x = torch.linspace(-20, 20, 101)
    torch.testing.assert_close(silu(x), F.silu(x))


def test_swiglu_matches_formula():
    ffn = SwiGLU(16, 40)
    assert (
        ffn.w1.weight.shape == (40, 16)
        and ffn.w3.weight.shape == (40, 16)
        and ffn.w2.weight.shape == (16, 40)
    )
    x = torch.randn(2, 5, 16, generator=gen(5))
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    torch.testing.assert_close(ffn(x), (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T)


def test_silu_feed_forward_matches_formula():
    ffn = SiLUFeedForward(16, 64)
    x = torch.randn(3, 16, generator=gen(6))
    torch.testing.assert_close(ffn(x), F.silu(x @ ffn.w1.weight.T) @ ffn.w2.weight.T)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_matches_torch_along_any_dim(dim):
    x = torch.randn(4, 5, 6, generator=gen(7))
    torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim))


def test_softmax_gradient_matches_torch():
    x = torch.randn(4, 9, generator=gen(25), dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 9, generator=gen(26), dtype=torch.float64)
    (ours,) = torch.autograd.grad((softmax(x, -1) * w).sum(), x)
    (expected,) = torch.autograd.grad((torch.softmax(x, -1) * w).sum(), x)
    torch.testing.assert_close(ours, expected)


def test_softmax_is_stable_for_huge_values_and_exact_zero_for_minus_inf():
    x = torch.tensor([[1000.0, 1001.0, 999.0], [-1e30, 0.0, float("-inf")]])
    out = softmax(x, -1)
    torch.testing.assert_close(out, torch.softmax(x.double(), -1).float())
    assert out[1, 2].item() == 0.0 and torch.isfinite(out).all()


def test_softmax_accumulates_low_precision_in_float32():
    x = torch.randn(3, 4096, generator=gen(8)).to(torch.bfloat16)
    out = softmax(x, -1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.softmax(x.float(), -1).to(torch.bfloat16), rtol=0, atol=0)


def test_attention_matches_torch_without_mask_with_extra_batch_dims():
    q = torch.randn(2, 3, 5, 8, generator=gen(9))
    k = torch.randn(2, 3, 7, 8, generator=gen(10))
    v = torch.randn(2, 3, 7, 4, generator=gen(11))
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_attention_matches_torch_with_boolean_mask_and_masked_probabilities_are_zero():
    q = torch.randn(4, 2, 6, 8, generator=gen(12))
    k = torch.randn(4, 2, 6, 8, generator=gen(13))
    mask = torch.rand(6, 6, generator=gen(14)) > 0.5
    mask[:, 0] = True  # every query may attend somewhere
    v = torch.eye(6).expand(4, 2, 6, 6)  # identity values: the output is the attention matrix itself
    out = scaled_dot_product_attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert (out[..., ~mask] == 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(4, 2, 6))


def test_attention_gradients_match_torch_with_mask_and_broadcast_keys():
    q = torch.randn(2, 3, 5, 8, generator=gen(20), dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 7, 8, generator=gen(21), dtype=torch.float64, requires_grad=True)  # shared by heads
    v = torch.randn(2, 1, 7, 4, generator=gen(22), dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 7, generator=gen(23)) > 0.4
    mask[:, 0] = True
    weights = torch.randn(2, 3, 5, 4, generator=gen(24), dtype=torch.float64)
    ours = torch.autograd.grad((scaled_dot_product_attention(q, k, v, mask) * weights).sum(), (q, k, v))
    expected = torch.autograd.grad(
        (
            F.scaled_dot_product_attention(q, k.expand(2, 3, 7, 8), v.expand(2, 3, 7, 4), attn_mask=mask)
            * weights
        ).sum(),
        (q, k, v),
    )
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("block_size", [1, 16, 64, 500])
@pytest.mark.parametrize("cached", [0, 37])
def test_causal_attention_by_blocks_matches_torch_with_gradients(block_size, cached):
    """150 queries (blocks of every size, the last one partial) after `cached` earlier keys, as when
    generating with a KV cache; keys and values shared by the heads, so that their gradients are summed."""
    queries, keys = 150, 150 + cached
    q = torch.randn(2, 3, queries, 8, generator=gen(30), dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, keys, 8, generator=gen(31), dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, keys, 4, generator=gen(32), dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 3, queries, 4, generator=gen(33), dtype=torch.float64)
    mask = torch.arange(cached, keys)[:, None] >= torch.arange(keys)[None, :]
    out = causal_attention(q, k, v, block_size=block_size)
    expected = F.scaled_dot_product_attention(
        q, k.expand(2, 3, keys, 8), v.expand(2, 3, keys, 4), attn_mask=mask
    )
    torch.testing.assert_close(out, expected)
    ours = torch.autograd.grad((out * weights).sum(), (q, k, v))
    theirs = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for got, want in zip(ours, theirs, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_rope_matches_complex_rotation_with_batch_dims_and_offset_positions():
    rope = RotaryPositionalEmbedding(10_000.0, 16, max_seq_len=64)
    x = torch.randn(2, 3, 5, 16, generator=gen(15))
    positions = torch.tensor([[3, 4, 5, 6, 7], [40, 41, 50, 60, 63]])[:, None, :]  # (2, 1, 5)
    torch.testing.assert_close(rope(x, positions), complex_rope(x, positions, 10_000.0))
    torch.testing.assert_close(rope(x, torch.arange(5)), complex_rope(x, torch.arange(5), 10_000.0))


def test_rope_has_no_parameters_and_its_buffers_are_not_saved():
    rope = RotaryPositionalEmbedding(10_000.0, 8, max_seq_len=16)
    assert list(rope.parameters()) == [] and rope.state_dict() == {}
    # The buffers are the table of cos/sin(i · θ^(-2k/d)) for every position i < 16 and pair k < 4.
    angles = [[i * 10_000.0 ** (-2 * k / 8) for k in range(4)] for i in range(16)]
    torch.testing.assert_close(rope.cos, torch.tensor(angles, dtype=torch.float64).cos().float())
    torch.testing.assert_close(rope.sin, torch.tensor(angles, dtype=torch.float64).sin().float())
    assert {name for name, _ in rope.named_buffers()} == {"cos", "sin"}


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryPositionalEmbedding(500.0, 8, max_seq_len=64)
    q, k = torch.randn(8, generator=gen(16)), torch.randn(8, generator=gen(17))

    def score(i: int, j: int) -> torch.Tensor:
        return rope(q, torch.tensor(i)) @ rope(k, torch.tensor(j))

    torch.testing.assert_close(score(10, 3), score(40, 33))


def reference_mhsa(mhsa: MultiHeadSelfAttention, x: torch.Tensor, theta: float | None, positions=None):
    """Causal multi-head attention from torch built-ins and the complex-number RoPE above."""
    h = mhsa.num_heads
    *batch, seq, d = x.shape

    def heads(t):
        return t.reshape(*batch, seq, h, d // h).transpose(-2, -3)

    q, k, v = (heads(F.linear(x, p.weight)) for p in (mhsa.q_proj, mhsa.k_proj, mhsa.v_proj))
    if theta is not None:
        pos = torch.arange(seq) if positions is None else positions[..., None, :]
        q, k = complex_rope(q, pos, theta), complex_rope(k, pos, theta)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(-2, -3).reshape(*batch, seq, d), mhsa.output_proj.weight)


@pytest.mark.parametrize("theta", [None, 10_000.0])
def test_multihead_self_attention_matches_reference(theta):
    torch.manual_seed(0)
    mhsa = MultiHeadSelfAttention(32, 4, max_seq_len=16, theta=theta)
    assert sorted(k.split(".")[0] for k in mhsa.state_dict()) == ["k_proj", "output_proj", "q_proj", "v_proj"]
    x = torch.randn(2, 3, 9, 32, generator=gen(18))
    torch.testing.assert_close(mhsa(x), reference_mhsa(mhsa, x, theta), atol=1e-5, rtol=1e-4)


def test_multihead_self_attention_with_given_positions_with_batch_dims():
    torch.manual_seed(0)
    mhsa = MultiHeadSelfAttention(32, 4, max_seq_len=32, theta=100.0)
    x = torch.randn(2, 6, 32, generator=gen(19))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]])
    torch.testing.assert_close(
        mhsa(x, positions), reference_mhsa(mhsa, x, 100.0, positions), atol=1e-5, rtol=1e-4
    )


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ScratchlmError, match="divisible"):
        MultiHeadSelfAttention(30, 4)
    with pytest.raises(ScratchlmError, match="max_seq_len"):
        MultiHeadSelfAttention(32, 4, theta=10_000.0)
    with pytest.raises(ScratchlmError, match="even"):
        RotaryPositionalEmbedding(10_000.0, 7, 8)


def test_causal_attention_backward_in_bfloat16_is_close_to_the_exact_one():
    """The hand-written backward pass on bfloat16 inputs (several query blocks, the last one partial) against
    the exact float64 attention of torch: relative error (Frobenius norm) of the output and of each gradient
    below 1.5 %, about twice what torch's own bfloat16 attention makes (measured: ours 0.4-0.7 %, torch's
    0.3-0.5 %). bfloat16 has an 8-bit mantissa, 0.4 % relative rounding per value."""
    g = gen(31)
    Q, K, V, grad_out = (torch.randn(2, 4, 150, 16, generator=g) for _ in range(4))

    def outputs_and_gradients(attention, dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in (Q, K, V))
        out = attention(q, k, v)
        out.backward(grad_out.to(dtype))
        return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]

    exact = outputs_and_gradients(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.float64
    )
    ours = outputs_and_gradients(causal_attention, torch.bfloat16)
    for name, e, o in zip(["output", "dQ", "dK", "dV"], exact, ours, strict=True):
        assert (o - e).norm() / e.norm() < 0.015, name
