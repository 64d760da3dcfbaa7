"""FlashAttention-2 (Dao, 2023) in Triton: exact softmax attention without the (queries × keys) matrix.

`O = softmax(Q Kᵀ s) V` (s = 1/sqrt(d_head) by default) is computed one block of `BLOCK_M` queries at a time
by one program, which streams over blocks of `BLOCK_N` keys and keeps, per query row, the running maximum `m`
of its scores, the running sum `l` of their exponentials and the running output `acc`:

    S = Q_blk K_jᵀ s                          (BLOCK_M × BLOCK_N, in registers only)
    m' = max(m, rowmax(S))                    the new maximum
    P = exp(S - m'),  α = exp(m - m')         α rescales what was summed under the old maximum
    l = α l + rowsum(P),  acc = α acc + P V_j,  m = m'

and at the end `O = acc / l` and the log-sum-exp `L = m + log l` of each row. Only `O` and `L` are written to
memory: the scores exist one block at a time. (FA2's change over FA1: the loop over keys is the inner one,
so each program owns its rows of O and divides by `l` once, at the end.) Exponentials are `exp2` of scores
premultiplied by log2(e), which is what the hardware computes; `L` is kept in those base-2 units.

The backward pass recomputes each block of probabilities from `L` (`P = exp2(S log2e - L)`, exact, no
running maximum needed) rather than storing them, with `D_i = Σ_c dO_ic O_ic` (= Σ_j P_ij dP_ij):

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P ⊙ (dP - D)      dK = s dSᵀ Q      dQ = s dS K

Two kernels, so that no two programs add into the same rows: one program per block of keys accumulates its
dK and dV over every query block (and, for grouped-query attention, every query head of its group) that sees
it; one program per block of queries accumulates its dQ over the keys it sees.

Grouped-query attention: query head h reads key/value head `h // (heads // kv_heads)` through the index,
so K and V are never repeated in memory; their gradients sum over the group inside the dK/dV program.

Causal: with `seq_q <= seq_k` queries are the last `seq_q` positions (generation after a KV cache), query i
at absolute position `offset + i`, `offset = seq_k - seq_q`, and sees keys `0 … offset + i`. Loops stop at
the last key block a query block sees (forward, dQ) or start at the first query block that sees a key block
(dK/dV); the boundary blocks are masked element by element. Every query sees key 0, so no row is empty.

Any head size from 16 to 256 runs in a block padded to the next power of two (masked loads, zero padding,
which adds nothing to a dot product); any sequence length, by masking the rows and columns past its end.

Products run in the input's dtype with float32 accumulation (`tl.dot`), as tensor cores do; the softmax
statistics are float32. Under Triton's CPU interpreter (`TRITON_INTERPRET=1`, which the tests use) the dot's
operands are cast to float32 first: the interpreter multiplies bfloat16 operands wrongly (it treats their
bit patterns as integers), and the cast only moves where the rounding-free product happens, so the
interpreted kernel computes what the compiled one does.

`flash_attention` is a `torch.autograd.Function` over two `torch.library` custom ops (forward, backward),
which `torch.compile(fullgraph=True)` traces as opaque calls with known output shapes.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from scratchlm.errors import ScratchlmError

#: Set when the kernels run under Triton's interpreter (read when this module is imported, as Triton does).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

LOG2_E = 1.4426950408889634
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


@triton.jit
def _dot(a, b, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr):
    """`a @ b` accumulated in float32. `FP32_DOTS` (the interpreter): operands cast to float32 first;
    `IEEE` (float32 inputs): full float32 products, not TF32, as `torch.matmul` computes them by default."""
    if FP32_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_rows(base, rows, stride, num_rows, head_dim, D_PAD: tl.constexpr):
    """Rows `rows` of a (num_rows, head_dim) matrix at `base` with row stride `stride`, padded to `D_PAD`
    columns, zeros past its ends."""
    offs_d = tl.arange(0, D_PAD)
    mask = (rows < num_rows)[:, None] & (offs_d < head_dim)[None, :]
    return tl.load(base + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(base, x, rows, num_rows, head_dim, D_PAD: tl.constexpr):
    """`x` (rows × `D_PAD`) into rows `rows` of the contiguous (num_rows, head_dim) matrix at `base`, in its
    dtype, nothing past its ends. The outputs (O, dQ, dK, dV) are all allocated contiguous."""
    offs_d = tl.arange(0, D_PAD)
    mask = (rows < num_rows)[:, None] & (offs_d < head_dim)[None, :]
    tl.store(base + rows[:, None] * head_dim + offs_d[None, :], x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _query_program(heads, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (i, bh) of the forward's and dQ's grid: block i of `BLOCK_M` queries of head h of batch b,
    bh = b · heads + h, which attends with key/value head h // GROUP. Returns i, the block's rows, bh, b, h
    and that key/value head."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    h = bh % heads
    return pid_m, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), bh, bh // heads, h, h // GROUP


@triton.jit
def _keys_seen(pid_m, offset, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """How far query block `pid_m` reads the keys: all of them, or (causal) up to its last query's position."""
    hi = seq_k
    if CAUSAL:  # the block's last query sees keys up to offset + (pid_m + 1) * BLOCK_M - 1
        hi = tl.minimum(seq_k, offset + (pid_m + 1) * BLOCK_M)
    return hi


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, LSE,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    heads, seq_q, seq_k, head_dim, scale_log2,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """O and L of one block of queries of one head, over the keys it sees."""
    pid_m, rows, bh, b, h, kv = _query_program(heads, GROUP, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, stride_qs, seq_q, head_dim, D_PAD)
    k_base = K + b * stride_kb + kv * stride_kh
    v_base = V + b * stride_vb + kv * stride_vh

    offset = seq_k - seq_q  # query i sits at key position offset + i
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start_n in range(0, _keys_seen(pid_m, offset, seq_k, CAUSAL, BLOCK_M), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, stride_ks, seq_k, head_dim, D_PAD)
        v = _load_rows(v_base, cols, stride_vs, seq_k, head_dim, D_PAD)
        s = _dot(q, tl.trans(k), FP32_DOTS, IEEE) * scale_log2
        # Rows past seq_q are left unmasked (never stored): masking them whole would make m = -inf and NaNs.
        visible = (cols < seq_k)[None, :]
        if CAUSAL:
            visible = visible & (rows[:, None] + offset >= cols[None, :])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOTS, IEEE)
        m = m_new

    _store_rows(OUT + bh * seq_q * head_dim, acc / row_sum[:, None], rows, seq_q, head_dim, D_PAD)
    tl.store(LSE + bh * seq_q + rows, m + tl.log2(row_sum), mask=rows < seq_q)


@triton.jit
def _probabilities(q, k, lse, rows, cols, offset, seq_q, seq_k, scale_log2,
                   CAUSAL: tl.constexpr, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """The block `P = exp2(Q Kᵀ s log2e - L)` of the forward's softmax, 0 where masked or out of range."""
    s = _dot(q, tl.trans(k), FP32_DOTS, IEEE) * scale_log2
    p = tl.exp2(s - lse[:, None])
    visible = (rows < seq_q)[:, None] & (cols < seq_k)[None, :]
    if CAUSAL:
        visible = visible & (rows[:, None] + offset >= cols[None, :])
    return tl.where(visible, p, 0.0)


@triton.jit
def _backward_rows(
    q_base, do_base, LSE, DELTA, bh, rows, stride_qs, stride_dos, seq_q, head_dim, D_PAD: tl.constexpr
):
    """What the backward reads of rows `rows` of head `bh` (of the batch × heads): Q and dO (at `q_base` and
    `do_base`), L and D; zeros past seq_q."""
    q = _load_rows(q_base, rows, stride_qs, seq_q, head_dim, D_PAD)
    do = _load_rows(do_base, rows, stride_dos, seq_q, head_dim, D_PAD)
    lse = tl.load(LSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    delta = tl.load(DELTA + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    return q, do, lse, delta


@triton.jit
def _backward_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    heads, kv_heads, seq_q, seq_k, head_dim, scale, scale_log2,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dK and dV of one block of keys of one key/value head, summed over its group's query heads."""
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    b, kv = bkv // kv_heads, bkv % kv_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + kv * stride_kh, cols, stride_ks, seq_k, head_dim, D_PAD)
    v = _load_rows(V + b * stride_vb + kv * stride_vh, cols, stride_vs, seq_k, head_dim, D_PAD)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)

    offset = seq_k - seq_q
    lo = 0
    if CAUSAL:  # the first query that sees key pid_n * BLOCK_N is query pid_n * BLOCK_N - offset
        lo = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for g in range(GROUP):
        h = kv * GROUP + g
        bh = b * heads + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        for start_m in range(lo, seq_q, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q, do, lse, delta = _backward_rows(
                q_base, do_base, LSE, DELTA, bh, rows, stride_qs, stride_dos, seq_q, head_dim, D_PAD
            )
            p = _probabilities(
                q, k, lse, rows, cols, offset, seq_q, seq_k, scale_log2, CAUSAL, FP32_DOTS, IEEE
            )
            dv += _dot(tl.trans(p.to(do.dtype)), do, FP32_DOTS, IEEE)
            dp = _dot(do, tl.trans(v), FP32_DOTS, IEEE)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, FP32_DOTS, IEEE)

    _store_rows(DK + bkv * seq_k * head_dim, dk * scale, cols, seq_k, head_dim, D_PAD)
    _store_rows(DV + bkv * seq_k * head_dim, dv, cols, seq_k, head_dim, D_PAD)


@triton.jit
def _backward_q_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    heads, seq_q, seq_k, head_dim, scale, scale_log2,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dQ of one block of queries of one head, over the keys it sees."""
    pid_m, rows, bh, b, h, kv = _query_program(heads, GROUP, BLOCK_M)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    q, do, lse, delta = _backward_rows(
        q_base, do_base, LSE, DELTA, bh, rows, stride_qs, stride_dos, seq_q, head_dim, D_PAD
    )
    k_base = K + b * stride_kb + kv * stride_kh
    v_base = V + b * stride_vb + kv * stride_vh
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    offset = seq_k - seq_q
    for start_n in range(0, _keys_seen(pid_m, offset, seq_k, CAUSAL, BLOCK_M), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, stride_ks, seq_k, head_dim, D_PAD)
        v = _load_rows(v_base, cols, stride_vs, seq_k, head_dim, D_PAD)
        p = _probabilities(q, k, lse, rows, cols, offset, seq_q, seq_k, scale_log2, CAUSAL, FP32_DOTS, IEEE)
        dp = _dot(do, tl.trans(v), FP32_DOTS, IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, FP32_DOTS, IEEE)

    _store_rows(DQ + bh * seq_q * head_dim, dq * scale, rows, seq_q, head_dim, D_PAD)


def _launch_settings(head_dim: int, dtype: torch.dtype) -> dict[str, int | bool]:
    """Block sizes and compile flags. The padded head dimension is a power of two ≥ 16 (`tl.dot`'s
    minimum); large heads take smaller key blocks so that a block of K and V stays in shared memory."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    return {
        "BLOCK_M": 64,
        "BLOCK_N": 64 if d_pad <= 128 else 32,
        "D_PAD": d_pad,
        "FP32_DOTS": INTERPRETED,
        "IEEE": dtype == torch.float32,
        "num_warps": 4 if d_pad <= 64 else 8,
    }


def _strides(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last_stride(x: Tensor) -> Tensor:
    """`x` with its last dimension contiguous, as the kernels index it (other strides are passed in)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("scratchlm::flash_attention_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    settings = _launch_settings(head_dim, q.dtype)
    grid = (triton.cdiv(seq_q, settings["BLOCK_M"]), batch * heads)
    _forward_kernel[grid](
        q, k, v, out, lse,
        *_strides(q), *_strides(k), *_strides(v),
        heads, seq_q, seq_k, head_dim, scale * LOG2_E,
        GROUP=heads // k.shape[1], CAUSAL=causal, **settings,
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
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    # D_i = Σ_c dO_ic O_ic = Σ_j P_ij dP_ij, the softmax backward's row term, from two (seq × d) tensors.
    delta = (grad_out.float() * out.float()).sum(dim=-1).contiguous()
    grad_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    settings = _launch_settings(head_dim, q.dtype)
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))
    flags = {"GROUP": heads // kv_heads, "CAUSAL": causal, **settings}
    _backward_kv_kernel[(triton.cdiv(seq_k, settings["BLOCK_N"]), batch * kv_heads)](
        q, k, v, grad_out, lse, delta, grad_k, grad_v, *common,
        heads, kv_heads, seq_q, seq_k, head_dim, scale, scale * LOG2_E, **flags,
    )  # fmt: skip
    _backward_q_kernel[(triton.cdiv(seq_q, settings["BLOCK_M"]), batch * heads)](
        q, k, v, grad_out, lse, delta, grad_q, *common,
        heads, seq_q, seq_k, head_dim, scale, scale * LOG2_E, **flags,
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
