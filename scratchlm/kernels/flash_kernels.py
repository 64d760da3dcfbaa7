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
it; one program per block of queries accumulates its dQ over the keys it sees. The dK/dV program computes
`Sᵀ = K Qᵀ` and `dPᵀ = V dOᵀ` directly, so the probabilities come out as `Pᵀ`, the orientation both of its
products want: what it computes is never transposed, only what it loads (Qᵀ is read transposed from memory,
and the transposed view of a loaded tile is free, a shared-memory descriptor rather than a register shuffle).

Grouped-query attention: query head h reads key/value head `h // group` through the index, so K and V are
never repeated in memory; their gradients sum over the group inside the dK/dV program.

Causal: with `seq_q <= seq_k` (generation after a KV cache) query i sits at key position `offset + i`,
`offset = seq_k - seq_q`, and sees keys `0 … offset + i`. The loops over the other side's blocks come in two:
the interior blocks, which every query of the block sees whole and which lie inside both sequences, run with
no mask at all (no compare, no select, unpredicated loads); only the boundary blocks (the causal diagonal, the
ends of the sequences) are masked element by element. Blocks the mask hides entirely are never visited.

Decoding (a few queries against a long cache) has too few query blocks to fill a GPU, so `_decode_kernel`
splits the keys instead (flash-decoding): one program per (key/value head, split of the keys, block of query
rows) with the group's query heads packed as rows, each writing a partial output and its log-sum-exp;
`_combine_kernel` merges the splits, `L = log2 Σ_s 2^L_s` and `O = Σ_s 2^(L_s - L) O_s`.

Any head size from 16 to 256 runs in a block padded to the next power of two (`HEAD_DIM` of `D_PAD` columns
loaded, zeros past it, which add nothing to a dot product); any sequence length. Offsets into the tensors are
64-bit (a (batch, heads, seq, d) tensor passes 2^31 elements at realistic sizes); the program indices and the
offsets inside a block are 32-bit.

Products run in the input's dtype with float32 accumulation (`tl.dot`), as tensor cores do; the softmax
statistics are float32. Under Triton's CPU interpreter (`TRITON_INTERPRET=1`, which the tests use) the dot's
operands are cast to float32 first: the interpreter multiplies bfloat16 operands wrongly (it treats their
bit patterns as integers), and the cast only moves where the rounding-free product happens, so the
interpreted kernel computes what the compiled one does.
"""

import os

import triton
import triton.language as tl

#: Set when the kernels run under Triton's interpreter (read when this module is imported, as Triton does).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

LOG2_E = 1.4426950408889634


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
def _head(base, b, h, stride_b, stride_h):
    """The (seq, d) matrix of batch row `b`, head `h`, with 64-bit offsets."""
    return base + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _program(heads, BLOCK: tl.constexpr):
    """Where this program sits in a grid of (batch × `heads`, blocks of `BLOCK` rows): its batch-and-head
    index `b · heads + h`, the batch row `b`, the head `h` and the first row of its block."""
    bh, block = tl.program_id(0), tl.program_id(1)
    return bh, bh // heads, bh % heads, block * BLOCK


@triton.jit
def _tile(base, start, stride, length, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
          TRANSPOSED: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """Rows `start … start + BLOCK - 1` of the (length, HEAD_DIM) matrix at `base` (row stride `stride`, unit
    column stride) as a (BLOCK, D_PAD) tile or, `TRANSPOSED`, its (D_PAD, BLOCK) transpose read straight from
    memory; zeros past the matrix's ends. `EVEN`: the rows all lie inside the matrix, so only padded columns
    (if any) are masked."""
    base += tl.cast(start, tl.int64) * stride
    offs, offs_d = tl.arange(0, BLOCK), tl.arange(0, D_PAD)
    if TRANSPOSED:
        ptrs = base + offs_d[:, None] + offs[None, :] * stride
        in_rows, in_cols = (start + offs < length)[None, :], (offs_d < HEAD_DIM)[:, None]
    else:
        ptrs = base + offs[:, None] * stride + offs_d[None, :]
        in_rows, in_cols = (start + offs < length)[:, None], (offs_d < HEAD_DIM)[None, :]
    if EVEN and HEAD_DIM == D_PAD:
        tile = tl.load(ptrs)
    elif EVEN:
        tile = tl.load(ptrs, mask=in_cols, other=0.0)
    else:
        tile = tl.load(ptrs, mask=in_rows & in_cols, other=0.0)
    return tile


@triton.jit
def _head_tile(base, b, h, stride_b, stride_h, stride_s, start, length, BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    """Rows `start …` of batch row `b`, head `h` of a (batch, heads, length, HEAD_DIM) tensor as a (BLOCK,
    D_PAD) tile: the block of queries or keys that a program owns."""
    matrix = _head(base, b, h, stride_b, stride_h)
    return _tile(matrix, start, stride_s, length, BLOCK, HEAD_DIM, D_PAD, False, False)


@triton.jit
def _store_tile(base, x, start, length, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """`x` (BLOCK × D_PAD) into rows `start …` of the contiguous (length, HEAD_DIM) matrix at `base`, in its
    dtype, nothing past its ends. The outputs (O, dQ, dK, dV) are all allocated contiguous."""
    offs, offs_d = tl.arange(0, BLOCK), tl.arange(0, D_PAD)
    ptrs = base + tl.cast(start, tl.int64) * HEAD_DIM + offs[:, None] * HEAD_DIM + offs_d[None, :]
    mask = (start + offs < length)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(base, rows, length):
    """One float32 per row (the log-sum-exps, the backward's D), 0 past `length`."""
    return tl.load(base + rows, mask=rows < length, other=0.0)


@triton.jit
def _interior_end(first, seq_k, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the interior key blocks of queries whose earliest position is `first` end: blocks below it lie
    inside the keys and (causal) before that position, so every one of those queries sees them whole."""
    end = seq_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        end = tl.minimum(end, (first + 1) // BLOCK_N * BLOCK_N)
    return end


@triton.jit
def _attend(acc, row_sum, m, q, k_base, v_base, stride_ks, stride_vs, positions, lo, hi, seq_k, scale_log2,
            BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
            D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """The online softmax over key blocks `lo, lo + BLOCK_N, … < hi` for query rows at key `positions`.
    `BOUNDARY`: the blocks may reach past the keys or (causal) past a query's position, so scores there are
    masked to -inf; interior blocks run without masks."""
    for start_n in range(lo, hi, BLOCK_N):
        kt = _tile(k_base, start_n, stride_ks, seq_k, BLOCK_N, HEAD_DIM, D_PAD, True, not BOUNDARY)
        v = _tile(v_base, start_n, stride_vs, seq_k, BLOCK_N, HEAD_DIM, D_PAD, False, not BOUNDARY)
        s = _dot(q, kt, FP32_DOTS, IEEE) * scale_log2
        if BOUNDARY:
            cols = start_n + tl.arange(0, BLOCK_N)
            visible = (cols < seq_k)[None, :]
            if CAUSAL:
                visible = visible & (positions[:, None] >= cols[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf (only in a split of the decode kernel: a query sees
        # every key up to its own, so in the forward kernel every row sees key 0); exponentiating against 0
        # instead keeps its P and α at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOTS, IEEE)
        m = m_new
    return acc, row_sum, m


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, LSE,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    heads, group, seq_q, seq_k, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """O and L of one block of queries of one head (program (b · heads + h, block)), over the keys it sees.
    Batch × heads is the grid's first axis, which CUDA allows 2^31 - 1 programs, the query blocks its second
    (65,535)."""
    bh, b, h, start_m = _program(heads, BLOCK_M)
    q = _head_tile(Q, b, h, stride_qb, stride_qh, stride_qs, start_m, seq_q, BLOCK_M, HEAD_DIM, D_PAD)
    k_base = _head(K, b, h // group, stride_kb, stride_kh)
    v_base = _head(V, b, h // group, stride_vb, stride_vh)

    offset = seq_k - seq_q  # query i sits at key position offset + i
    positions = offset + start_m + tl.arange(0, BLOCK_M)
    interior = _interior_end(offset + start_m, seq_k, CAUSAL, BLOCK_N)
    end = seq_k
    if CAUSAL:  # the block's last query sees keys up to offset + start_m + BLOCK_M - 1
        end = tl.minimum(seq_k, offset + start_m + BLOCK_M)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    acc, row_sum, m = _attend(
        acc, row_sum, m, q, k_base, v_base, stride_ks, stride_vs, positions, 0, interior, seq_k, scale_log2,
        False, CAUSAL, BLOCK_N, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
    )  # fmt: skip
    acc, row_sum, m = _attend(
        acc, row_sum, m, q, k_base, v_base, stride_ks, stride_vs, positions, interior, end, seq_k,
        scale_log2, True, CAUSAL, BLOCK_N, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
    )  # fmt: skip

    # Rows past seq_q were computed (every row sees key 0, so nothing is NaN) and are not stored.
    out = acc / row_sum[:, None]
    _store_tile(OUT + bh.to(tl.int64) * seq_q * HEAD_DIM, out, start_m, seq_q, BLOCK_M, HEAD_DIM, D_PAD)
    rows = start_m + tl.arange(0, BLOCK_M)
    tl.store(LSE + bh.to(tl.int64) * seq_q + rows, m + tl.log2(row_sum), mask=rows < seq_q)


@triton.jit
def _decode_kernel(
    Q, K, V, PARTIAL_OUT, PARTIAL_LSE,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    batch, heads, kv_heads, group, seq_q, seq_k, chunk, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One split of the keys, `[split · chunk, (split + 1) · chunk)`, against one block of the query rows of
    one key/value head: its group's query heads × the seq_q queries, packed as row `g · seq_q + i`, so that
    one decoded token of G heads fills G rows of one tile rather than one row each of G tiles. Writes the
    split's normalised output and log-sum-exp (-inf, output 0, where a query sees none of its keys)."""
    bkv, split, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = bkv // kv_heads, bkv % kv_heads
    r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    h, i = kv * group + r // seq_q, r % seq_q
    offs_d = tl.arange(0, D_PAD)
    q_rows = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + i.to(tl.int64) * stride_qs
    inside = (r < group * seq_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=inside, other=0.0)
    k_base = _head(K, b, kv, stride_kb, stride_kh)
    v_base = _head(V, b, kv, stride_vb, stride_vh)

    offset = seq_k - seq_q
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_k)
    interior = tl.minimum(tl.maximum(_interior_end(offset, seq_k, CAUSAL, BLOCK_N), lo), hi)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    acc, row_sum, m = _attend(
        acc, row_sum, m, q, k_base, v_base, stride_ks, stride_vs, offset + i, lo, interior, seq_k,
        scale_log2, False, CAUSAL, BLOCK_N, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
    )  # fmt: skip
    acc, row_sum, m = _attend(
        acc, row_sum, m, q, k_base, v_base, stride_ks, stride_vs, offset + i, interior, hi, seq_k,
        scale_log2, True, CAUSAL, BLOCK_N, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
    )  # fmt: skip

    # Partial results are (splits, batch, heads, seq_q[, HEAD_DIM]), contiguous.
    out_rows = ((split * batch + b).to(tl.int64) * heads + h) * seq_q + i
    seen = row_sum > 0
    row_sum = tl.where(seen, row_sum, 1.0)  # unseen rows: acc is 0, and so is their output
    tl.store(
        PARTIAL_OUT + out_rows[:, None] * HEAD_DIM + offs_d[None, :], acc / row_sum[:, None], mask=inside
    )
    lse = tl.where(seen, m + tl.log2(row_sum), float("-inf"))
    tl.store(PARTIAL_LSE + out_rows, lse, mask=r < group * seq_q)


@triton.jit
def _combine_kernel(PARTIAL_OUT, PARTIAL_LSE, OUT, LSE, rows, splits,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    """`BLOCK_M` rows of the output from their splits' partial outputs `O_s` and log-sum-exps `L_s`:
    `L = log2 Σ 2^L_s`, `O = Σ 2^(L_s - L) O_s`. The largest `L_s` is found first and subtracted (a split that
    a query cannot see has `L_s = -inf`, weight 0; every query sees some split)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    inside = (row < rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(splits):
        top = tl.maximum(
            top, tl.load(PARTIAL_LSE + tl.cast(s, tl.int64) * rows + row, mask=row < rows, other=0.0)
        )
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s in range(splits):
        weight = tl.exp2(
            tl.load(PARTIAL_LSE + tl.cast(s, tl.int64) * rows + row, mask=row < rows, other=0.0) - top
        )
        part = tl.load(
            PARTIAL_OUT + (tl.cast(s, tl.int64) * rows + row)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=inside,
            other=0.0,
        )
        total += weight
        acc += weight[:, None] * part
    out = acc / total[:, None]
    tl.store(OUT + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=inside)
    tl.store(LSE + row, top + tl.log2(total), mask=row < rows)


@triton.jit
def _accumulate_kv(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, cols, offset,
                   lo, hi, seq_q, scale_log2, BOUNDARY: tl.constexpr, BLOCK_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr,
                   IEEE: tl.constexpr):  # fmt: skip
    """dK and dV of one key block over the query blocks `lo, lo + BLOCK_M, … < hi` of one query head, all in
    the keys' orientation: `Sᵀ = K Qᵀ`, `dV += Pᵀ dO`, `dPᵀ = V dOᵀ`, `dK += dSᵀ Q`. `BOUNDARY`: the causal
    diagonal, masked. Needs no other mask: rows past seq_q load as zeros (Q, dO, L and D), so they add
    nothing, and columns past seq_k only touch rows of dK and dV that are never stored."""
    for start_m in range(lo, hi, BLOCK_M):
        q = _tile(q_base, start_m, stride_qs, seq_q, BLOCK_M, HEAD_DIM, D_PAD, False, False)
        qt = _tile(q_base, start_m, stride_qs, seq_q, BLOCK_M, HEAD_DIM, D_PAD, True, False)
        do = _tile(do_base, start_m, stride_dos, seq_q, BLOCK_M, HEAD_DIM, D_PAD, False, False)
        dot = _tile(do_base, start_m, stride_dos, seq_q, BLOCK_M, HEAD_DIM, D_PAD, True, False)
        rows = start_m + tl.arange(0, BLOCK_M)
        lse, delta = _load_rows(lse_base, rows, seq_q), _load_rows(delta_base, rows, seq_q)
        pt = tl.exp2(_dot(k, qt, FP32_DOTS, IEEE) * scale_log2 - lse[None, :])
        if BOUNDARY:
            pt = tl.where(rows[None, :] + offset >= cols[:, None], pt, 0.0)
        dv += _dot(pt.to(do.dtype), do, FP32_DOTS, IEEE)
        dst = pt * (_dot(v, dot, FP32_DOTS, IEEE) - delta[None, :])
        dk += _dot(dst.to(q.dtype), q, FP32_DOTS, IEEE)
    return dk, dv


@triton.jit
def _backward_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    heads, kv_heads, group, seq_q, seq_k, scale, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dK and dV of one block of keys of one key/value head (program (b · kv_heads + kv, block)), summed
    over its group's query heads."""
    bkv, b, kv, start_n = _program(kv_heads, BLOCK_N)
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _head_tile(K, b, kv, stride_kb, stride_kh, stride_ks, start_n, seq_k, BLOCK_N, HEAD_DIM, D_PAD)
    v = _head_tile(V, b, kv, stride_vb, stride_vh, stride_vs, start_n, seq_k, BLOCK_N, HEAD_DIM, D_PAD)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)

    offset = seq_k - seq_q
    lo, interior = 0, 0
    if CAUSAL:
        # Query block m sees some of these keys from the block holding query start_n - offset on, and all of
        # them once its first query's position offset + m reaches the last key, start_n + BLOCK_N - 1.
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        interior = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
    for g in range(group):
        h = kv * group + g
        bh = (b * heads + h).to(tl.int64)
        q_base = _head(Q, b, h, stride_qb, stride_qh)
        do_base = _head(DO, b, h, stride_dob, stride_doh)
        dk, dv = _accumulate_kv(
            dk, dv, k, v, q_base, do_base, LSE + bh * seq_q, DELTA + bh * seq_q, stride_qs, stride_dos, cols,
            offset, lo, tl.minimum(interior, seq_q), seq_q, scale_log2, True, BLOCK_M, HEAD_DIM, D_PAD,
            FP32_DOTS, IEEE,
        )  # fmt: skip
        dk, dv = _accumulate_kv(
            dk, dv, k, v, q_base, do_base, LSE + bh * seq_q, DELTA + bh * seq_q, stride_qs, stride_dos, cols,
            offset, interior, seq_q, seq_q, scale_log2, False, BLOCK_M, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
        )  # fmt: skip

    kv_rows = bkv.to(tl.int64) * seq_k * HEAD_DIM
    _store_tile(DK + kv_rows, dk * scale, start_n, seq_k, BLOCK_N, HEAD_DIM, D_PAD)
    _store_tile(DV + kv_rows, dv, start_n, seq_k, BLOCK_N, HEAD_DIM, D_PAD)


@triton.jit
def _accumulate_q(dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, positions, lo, hi, seq_k,
                  scale_log2, BOUNDARY: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr,
                  IEEE: tl.constexpr):  # fmt: skip
    """dQ of one query block over the key blocks `lo, lo + BLOCK_N, … < hi`, with Kᵀ and Vᵀ read transposed
    from memory. `BOUNDARY`: keys past seq_k or (causal) a query's position are masked."""
    for start_n in range(lo, hi, BLOCK_N):
        k = _tile(k_base, start_n, stride_ks, seq_k, BLOCK_N, HEAD_DIM, D_PAD, False, not BOUNDARY)
        kt = _tile(k_base, start_n, stride_ks, seq_k, BLOCK_N, HEAD_DIM, D_PAD, True, not BOUNDARY)
        vt = _tile(v_base, start_n, stride_vs, seq_k, BLOCK_N, HEAD_DIM, D_PAD, True, not BOUNDARY)
        p = tl.exp2(_dot(q, kt, FP32_DOTS, IEEE) * scale_log2 - lse[:, None])
        if BOUNDARY:
            cols = start_n + tl.arange(0, BLOCK_N)
            visible = (cols < seq_k)[None, :]
            if CAUSAL:
                visible = visible & (positions[:, None] >= cols[None, :])
            p = tl.where(visible, p, 0.0)
        ds = p * (_dot(do, vt, FP32_DOTS, IEEE) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, FP32_DOTS, IEEE)
    return dq


@triton.jit
def _backward_q_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    heads, group, seq_q, seq_k, scale, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32_DOTS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dQ of one block of queries of one head (program (b · heads + h, block)), over the keys it sees."""
    bh, b, h, start_m = _program(heads, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _head_tile(Q, b, h, stride_qb, stride_qh, stride_qs, start_m, seq_q, BLOCK_M, HEAD_DIM, D_PAD)
    do = _head_tile(DO, b, h, stride_dob, stride_doh, stride_dos, start_m, seq_q, BLOCK_M, HEAD_DIM, D_PAD)
    lse = _load_rows(LSE + bh.to(tl.int64) * seq_q, rows, seq_q)
    delta = _load_rows(DELTA + bh.to(tl.int64) * seq_q, rows, seq_q)
    k_base = _head(K, b, h // group, stride_kb, stride_kh)
    v_base = _head(V, b, h // group, stride_vb, stride_vh)

    offset = seq_k - seq_q
    interior = _interior_end(offset + start_m, seq_k, CAUSAL, BLOCK_N)
    end = seq_k
    if CAUSAL:
        end = tl.minimum(seq_k, offset + start_m + BLOCK_M)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    dq = _accumulate_q(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offset + rows, 0, interior, seq_k,
        scale_log2, False, CAUSAL, BLOCK_N, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
    )  # fmt: skip
    dq = _accumulate_q(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offset + rows, interior, end, seq_k,
        scale_log2, True, CAUSAL, BLOCK_N, HEAD_DIM, D_PAD, FP32_DOTS, IEEE,
    )  # fmt: skip

    _store_tile(DQ + bh.to(tl.int64) * seq_q * HEAD_DIM, dq * scale, start_m, seq_q, BLOCK_M, HEAD_DIM, D_PAD)


#: The kernels by the name the launch settings use.
KERNELS = {
    "forward": _forward_kernel,
    "decode": _decode_kernel,
    "combine": _combine_kernel,
    "backward_kv": _backward_kv_kernel,
    "backward_q": _backward_q_kernel,
}
