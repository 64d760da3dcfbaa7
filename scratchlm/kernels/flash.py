"""`flash_attention`: FlashAttention-2 (`scratchlm.kernels.flash_kernels`) as a differentiable PyTorch op.

The forward and the backward are two `torch.library` custom ops with fake implementations, called from a
`torch.autograd.Function`, so `torch.compile(fullgraph=True)` traces them as opaque calls with known output
shapes. Each launch takes its block sizes from `scratchlm.kernels.launch` (the first of a ladder that fits the
device's shared memory) and runs under the tensors' device, whichever is current.

A handful of queries against many keys (decoding with a KV cache) takes the split-key decode kernel and its
combine step instead of the forward kernel: it produces the same output and log-sum-exp, so the backward is
the same.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
from jaxtyping import Float
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.kernels.flash_kernels import (
    INTERPRETED,
    LOG2_E,
    _backward_kv_kernel,
    _backward_q_kernel,
    _combine_kernel,
    _decode_kernel,
    _forward_kernel,
)
from scratchlm.kernels.launch import constexprs, multiprocessors, settings_for

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
#: Up to this many queries per head, the forward splits the keys (decode) rather than the queries.
DECODE_QUERIES = 16
#: Splits of the keys in decoding: enough to fill a GPU, few enough that combining them stays cheap.
MAX_SPLITS = 128
#: The streaming multiprocessors assumed under the interpreter, which has none; few, so that the tests'
#: short sequences are split.
INTERPRETER_SMS = 4


def decode_splits(programs: int, seq_k: int, block_n: int, sm_count: int) -> tuple[int, int]:
    """How decoding splits `seq_k` keys when `programs` (key/value head, block of query rows) pairs share
    them: about two programs per multiprocessor in all, each split a whole number of key blocks. Returns the
    number of splits and the keys per split."""
    blocks = triton.cdiv(seq_k, block_n)
    wanted = min(blocks, MAX_SPLITS, max(1, triton.cdiv(2 * sm_count, programs)))
    chunk = triton.cdiv(blocks, wanted) * block_n
    return triton.cdiv(seq_k, chunk), chunk


def _grid(*programs: int) -> tuple[int, ...]:
    """A launch grid within CUDA's limits: 2^31 - 1 programs along the first axis (batch × heads), 65,535 along
    the others (blocks of a sequence, splits)."""
    if programs[0] >= 2**31 or any(n > 65_535 for n in programs[1:]):
        raise ScratchlmError(
            f"flash_attention would launch a grid of {programs} programs, past CUDA's (2^31 - 1, 65,535, 65,535): "
            "the sequences are too long for these launch settings"
        )
    return programs


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launches go to the current CUDA device; this makes it the tensors' own."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kind: str, q: Tensor, causal: bool) -> tuple[int, int, dict[str, object]]:
    """`kind`'s block sizes on q's device, and the keyword arguments of its launch."""
    settings = settings_for(kind, q.device, q.dtype, q.shape[-1], causal)
    options = {"num_warps": settings.num_warps, "num_stages": settings.num_stages}
    return (
        settings.block_m,
        settings.block_n,
        constexprs(kind, settings, q.shape[-1], causal, INTERPRETED, q.dtype) | options,
    )


def _strides(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last_stride(x: Tensor) -> Tensor:
    """`x` with its last dimension contiguous, as the kernels index it (other strides are passed in)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return multiprocessors(device)


def _decode(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float) -> None:
    """The forward of a few queries: the keys split across programs, then the splits combined."""
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_m, block_n, kwargs = _launch("decode", q, causal)
    row_blocks = triton.cdiv(group * seq_q, block_m)
    splits, chunk = decode_splits(batch * kv_heads * row_blocks, seq_k, block_n, _sm_count(q.device))
    partial_out = torch.empty((splits, *q.shape), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((splits, *lse.shape), dtype=torch.float32, device=q.device)
    _decode_kernel[_grid(batch * kv_heads, splits, row_blocks)](
        q, k, v, partial_out, partial_lse,
        *_strides(q), *_strides(k), *_strides(v),
        batch, heads, kv_heads, group, seq_q, seq_k, chunk, scale * LOG2_E, **kwargs,
    )  # fmt: skip
    rows = batch * heads * seq_q
    block_m, _, kwargs = _launch("combine", q, causal)
    _combine_kernel[_grid(triton.cdiv(rows, block_m))](
        partial_out, partial_lse, out, lse, rows, splits, **kwargs
    )


@torch.library.custom_op("scratchlm::flash_attention_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    with _on(q.device):
        if seq_q <= DECODE_QUERIES:
            _decode(q, k, v, out, lse, causal, scale)
            return out, lse
        block_m, _, kwargs = _launch("forward", q, causal)
        _forward_kernel[_grid(batch * heads, triton.cdiv(seq_q, block_m))](
            q, k, v, out, lse,
            *_strides(q), *_strides(k), *_strides(v),
            heads, heads // kv_heads, seq_q, seq_k, scale * LOG2_E, **kwargs,
        )  # fmt: skip
    return out, lse


@_forward_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    # Contiguous, as the op's outputs are, whatever the inputs' strides.
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("scratchlm::flash_attention_backward", mutates_args=())
def _backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, grad_out = (_unit_last_stride(x) for x in (q, k, v, grad_out.to(q.dtype)))
    batch, heads, seq_q, _ = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    # D_i = Σ_c dO_ic O_ic = Σ_j P_ij dP_ij, the softmax backward's row term, from two (seq × d) tensors.
    delta = (grad_out.float() * out.float()).sum(dim=-1).contiguous()
    grad_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))
    with _on(q.device):
        _, block_n, kwargs = _launch("backward_kv", q, causal)
        _backward_kv_kernel[_grid(batch * kv_heads, triton.cdiv(seq_k, block_n))](
            q, k, v, grad_out, lse, delta, grad_k, grad_v, *strides,
            heads, kv_heads, heads // kv_heads, seq_q, seq_k, scale, scale * LOG2_E, **kwargs,
        )  # fmt: skip
        block_m, _, kwargs = _launch("backward_q", q, causal)
        _backward_q_kernel[_grid(batch * heads, triton.cdiv(seq_q, block_m))](
            q, k, v, grad_out, lse, delta, grad_q, *strides,
            heads, heads // kv_heads, seq_q, seq_k, scale, scale * LOG2_E, **kwargs,
        )  # fmt: skip
    return grad_q, grad_k, grad_v


@_backward_op.register_fake
def _(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class FlashAttention(torch.autograd.Function):
    """Forward: the kernel's output and log-sum-exp (kept); backward: the two gradient kernels."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
        out, lse = _forward_op(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _backward_op(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
        return grad_q, grad_k, grad_v, None, None


def flash_attention(
    q: Float[Tensor, "batch heads seq_q d_head"],
    k: Float[Tensor, "batch kv_heads seq_k d_head"],
    v: Float[Tensor, "batch kv_heads seq_k d_head"],
    causal: bool = True,
    scale: float | None = None,
) -> Float[Tensor, "batch heads seq_q d_head"]:
    """`softmax(q kᵀ · scale) v` per head (scale 1/sqrt(d_head) by default), query head h attending with
    key/value head `h // (heads / kv_heads)`; `causal`: the queries are the last `seq_q` of the `seq_k`
    positions and see only the keys up to their own. Differentiable in q, k and v.

    Runs on a CUDA device, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` set before this
    module is imported; slow, for tests)."""
    _check_inputs(q, k, v, causal)
    return FlashAttention.apply(
        q, k, v, causal, 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    )


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ScratchlmError(
                f"flash_attention needs 4-D {name} (batch, heads, seq, d_head), got shape {tuple(x.shape)}"
            )
        if x.dtype not in DTYPES:
            raise ScratchlmError(
                f"flash_attention supports float32, bfloat16 and float16, got {name} of dtype {x.dtype}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ScratchlmError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ScratchlmError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ScratchlmError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (batch, heads, seq_q, head_dim), (kv_batch, kv_heads, seq_k, kv_dim) = q.shape, k.shape
    if kv_batch != batch or kv_dim != head_dim:
        raise ScratchlmError(
            f"k and v must be (batch={batch}, kv_heads, seq_k, d_head={head_dim}) to match q, "
            f"got {tuple(k.shape)}"
        )
    if heads % kv_heads:
        raise ScratchlmError(f"the kv_heads of k and v ({kv_heads}) must divide the heads of q ({heads})")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ScratchlmError(
            f"flash_attention supports d_head {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, got {head_dim}"
        )
    if seq_q == 0 or seq_k == 0:
        raise ScratchlmError(f"flash_attention needs at least one query and one key, got {seq_q} and {seq_k}")
    if causal and seq_q > seq_k:
        raise ScratchlmError(
            f"causal attention places the {seq_q} queries at the last positions of the keys, so it needs "
            f"seq_q <= seq_k, got seq_k = {seq_k}"
        )
    if q.device.type != "cuda" and not INTERPRETED:
        raise ScratchlmError(
            f"flash_attention runs on a CUDA device (or under Triton's interpreter, TRITON_INTERPRET=1); "
            f"got tensors on {q.device}"
        )
