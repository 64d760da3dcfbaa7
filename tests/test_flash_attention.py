"""`scratchlm.kernels.flash_attention` (Triton FlashAttention-2) against plain softmax attention in float64:
output and the gradients of q, k and v, over odd lengths, grouped-query ratios, fewer queries than keys,
causal or not, head sizes and dtypes. Without a CUDA device the kernels run under Triton's interpreter
(conftest sets TRITON_INTERPRET=1 before the kernels are defined)."""

import math
import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("triton is not installed", allow_module_level=True)

from scratchlm.errors import ScratchlmError
from scratchlm.kernels import flash_attention
from scratchlm.kernels.flash import INTERPRETED

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: (atol, rtol) against float64: products of bfloat16/float16 operands, accumulated in float32, and the
#: probabilities rounded to the input dtype before their product with V (as on a GPU).
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2)}


def reference_attention(q, k, v, causal, scale=None):
    """softmax(q kᵀ s) v in float64, k and v repeated over each group of query heads."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:  # query i sits at position seq_k - seq_q + i
        seq_q, seq_k = q.shape[2], k.shape[2]
        visible = torch.arange(seq_q)[:, None] + (seq_k - seq_q) >= torch.arange(seq_k)[None, :]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def check_against_reference(
    batch, heads, kv_heads, seq_q, seq_k, d_head, causal, dtype, scale=None, seed=0, device=DEVICE
):
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = (
        tensor(batch, heads, seq_q, d_head),
        tensor(batch, kv_heads, seq_k, d_head),
        tensor(batch, kv_heads, seq_k, d_head),
    )
    grad_out = tensor(batch, heads, seq_q, d_head)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_attention(*inputs, causal=causal, scale=scale)
    out.backward(grad_out)
    exact_inputs = [x.double().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*exact_inputs, causal, scale)
    expected.backward(grad_out.double())

    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    for name, x, exact in zip("qkv", inputs, exact_inputs, strict=True):
        assert x.grad.dtype == dtype, name
        torch.testing.assert_close(x.grad.double(), exact.grad, atol=atol, rtol=rtol, msg=f"d{name}")


def test_runs_interpreted_without_cuda():
    # Guards the suite's premise: on a CPU-only machine the kernels are the interpreter's, not compiled.
    assert (os.environ.get("TRITON_INTERPRET") == "1") == INTERPRETED
    if DEVICE == "cpu":
        assert INTERPRETED


@pytest.mark.parametrize(
    "seq_q, seq_k",
    [(1, 1), (17, 17), (33, 33), (100, 100), (1, 33), (17, 100), (64, 130)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_odd_lengths_and_fewer_queries_than_keys(seq_q, seq_k, causal):
    check_against_reference(1, 2, 2, seq_q, seq_k, 32, causal, torch.float32)


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_ratios(heads, kv_heads, causal):
    check_against_reference(2, heads, kv_heads, 33, 40, 16, causal, torch.float32)


@pytest.mark.parametrize("d_head", [16, 24, 32, 64, 80, 128])
def test_head_sizes_padded_to_a_power_of_two(d_head):
    check_against_reference(1, 2, 1, 40, 40, d_head, True, torch.float32)


def test_largest_head_size():
    check_against_reference(1, 1, 1, 20, 37, 256, True, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_low_precision(dtype, causal):
    check_against_reference(1, 4, 2, 70, 70, 64, causal, dtype)


def test_low_precision_fewer_queries_than_keys():
    check_against_reference(1, 2, 1, 5, 80, 32, True, torch.bfloat16)


def test_explicit_scale():
    check_against_reference(1, 2, 1, 17, 17, 16, True, torch.float32, scale=0.5)


def test_strided_inputs_as_the_model_passes_them():
    # (batch, seq, heads, d) projections viewed as (batch, heads, seq, d): no copy is needed.
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 19, 4, 16, generator=generator).to(DEVICE).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    torch.testing.assert_close(
        flash_attention(q, k, v).double(), reference_attention(q, k, v, True), atol=2e-5, rtol=2e-5
    )


def test_compiles_without_graph_breaks():
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=generator).to(DEVICE).requires_grad_() for _ in range(3))
    compiled = torch.compile(
        lambda q, k, v: flash_attention(q, k, v).square().sum(), fullgraph=True, backend="aot_eager"
    )
    grads = torch.autograd.grad(compiled(q, k, v), [q, k, v])
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad(reference_attention(*exact, True).square().sum(), exact)
    for grad, grad_expected in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad.double(), grad_expected, atol=2e-5, rtol=2e-5)


def test_custom_ops_pass_torch_library_checks():
    # Fake (meta) implementations that match the real outputs' shapes, dtypes and strides, for strided inputs
    # too, and a backward that autograd and torch.compile can both call.
    from scratchlm.kernels.flash import _backward_op, _forward_op

    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 7, 4, 16, generator=generator).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(1, 2, 7, 16, generator=generator).to(DEVICE) for _ in range(2))
    out, lse = _forward_op(q, k, v, True, 0.25)
    torch.library.opcheck(_forward_op, (q, k, v, True, 0.25))
    torch.library.opcheck(
        _backward_op,
        (torch.randn_like(out).transpose(1, 2).contiguous().transpose(1, 2), q, k, v, out, lse, True, 0.25),
    )


def x(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    "q, k, v, causal, message",
    [
        (x(2, 16, 16), x(2, 16, 16), x(2, 16, 16), True, "4-D q"),
        (x(1, 2, 4, 16), x(1, 2, 4, 16), x(1, 2, 5, 16), True, "same shape"),
        (x(1, 2, 4, 16), x(2, 2, 4, 16), x(2, 2, 4, 16), True, "batch=1"),
        (x(1, 2, 4, 16), x(1, 2, 4, 32), x(1, 2, 4, 32), True, "d_head=16"),
        (
            x(1, 3, 4, 16),
            x(1, 2, 4, 16),
            x(1, 2, 4, 16),
            True,
            r"kv_heads of k and v \(2\) must divide the heads of q \(3\)",
        ),
        (x(1, 2, 4, 8), x(1, 2, 4, 8), x(1, 2, 4, 8), True, "d_head 16 to 256, got 8"),
        (x(1, 2, 4, 512), x(1, 2, 4, 512), x(1, 2, 4, 512), True, "got 512"),
        (x(1, 2, 0, 16), x(1, 2, 4, 16), x(1, 2, 4, 16), True, "at least one query"),
        (x(1, 2, 5, 16), x(1, 2, 4, 16), x(1, 2, 4, 16), True, "seq_q <= seq_k"),
        (x(1, 2, 4, 16), x(1, 2, 4, 16, dtype=torch.float16), x(1, 2, 4, 16), True, "share a dtype"),
        (
            x(1, 2, 4, 16, dtype=torch.float64),
            x(1, 2, 4, 16, dtype=torch.float64),
            x(1, 2, 4, 16, dtype=torch.float64),
            True,
            "torch.float64",
        ),
    ],
)
def test_bad_inputs_are_named(q, k, v, causal, message):
    with pytest.raises(ScratchlmError, match=message):
        flash_attention(q, k, v, causal=causal)


def test_more_queries_than_keys_is_fine_without_the_causal_mask():
    check_against_reference(1, 1, 1, 9, 4, 16, False, torch.float32)
