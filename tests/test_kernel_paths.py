"""The attention kernels' code paths against float64, under Triton's interpreter without a GPU: the unmasked
interior loops and the masked boundary blocks at several block shapes, the split-key decode kernel and its
combine step (output and log-sum-exp), and 64-bit offsets into tensors past 2^31 elements."""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from test_flash_attention import DEVICE, TOLERANCES, check_against_reference, reference_attention

import scratchlm.kernels.flash as flash
from scratchlm.errors import ScratchlmError
from scratchlm.kernels import flash_attention
from scratchlm.kernels.launch import LADDERS, Settings

#: Block shapes per kernel; the interpreter's default is the ladders' smallest, 32 × 32.
BLOCKS = {
    "64x32": {"forward": (64, 32), "backward_kv": (64, 32), "backward_q": (64, 32), "decode": (16, 32)},
    "32x64": {"forward": (32, 64), "backward_kv": (32, 64), "backward_q": (32, 64), "decode": (16, 64)},
    "128x64": {"forward": (128, 64), "backward_kv": (32, 128), "backward_q": (128, 32), "decode": (16, 128)},
}


def force(monkeypatch, blocks: dict[str, tuple[int, int]]) -> None:
    """Launch every kernel with the given block shapes instead of the ladders' choice."""

    def settings_for(kind, device, dtype, head_dim, causal):
        if kind not in blocks:
            return LADDERS[kind][16][-1]
        return Settings(*blocks[kind], 4, 1)

    monkeypatch.setattr(flash, "settings_for", settings_for)


@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k, d_head", [(100, 100, 40), (70, 130, 64)])
def test_interior_and_boundary_blocks_at_several_block_shapes(
    monkeypatch, blocks, causal, seq_q, seq_k, d_head
):
    # Long enough for several blocks each way: interior blocks (unmasked, with or without padded columns:
    # d_head 40 pads to 64, 64 does not) and boundary ones (the diagonal, the ends), with grouped queries.
    force(monkeypatch, BLOCKS[blocks])
    check_against_reference(1, 4, 2, seq_q, seq_k, d_head, causal, torch.float32)


def test_interior_blocks_in_bfloat16(monkeypatch):
    force(monkeypatch, BLOCKS["32x64"])
    check_against_reference(1, 2, 1, 150, 150, 64, True, torch.bfloat16)


def reference_lse(q, k, causal):
    """log2 Σ_j exp(q·k_j / sqrt(d)) per query, in float64: the kernels' log-sum-exp, in base 2."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        seq_q, seq_k = q.shape[2], k.shape[2]
        visible = torch.arange(seq_q)[:, None] + (seq_k - seq_q) >= torch.arange(seq_k)[None, :]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.logsumexp(scores, dim=-1) / math.log(2)


@pytest.mark.parametrize(
    "heads, kv_heads, seq_q, seq_k, causal, sms",
    [
        (4, 2, 1, 100, True, 4),  # one token, two query heads per key/value head packed as rows
        (4, 1, 16, 40, True, 8),  # 64 packed rows; the split [32, 40) is invisible to the first 8 queries
        (8, 2, 5, 300, True, 64),  # many splits, two blocks of packed rows
        (2, 2, 3, 97, False, 16),
        (2, 1, 1, 1, True, 4),  # a single key: one split
    ],
)
def test_decode_splits_the_keys_and_combines_them_exactly(
    monkeypatch, heads, kv_heads, seq_q, seq_k, causal, sms
):
    force(monkeypatch, {"decode": (16, 32)})
    monkeypatch.setattr(flash, "INTERPRETER_SMS", sms)
    chosen, decode_splits = [], flash.decode_splits

    def recording(*args):
        chosen.append(decode_splits(*args))
        return chosen[-1]

    monkeypatch.setattr(flash, "decode_splits", recording)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, heads, seq_q, 24, generator=generator).to(DEVICE)
    k, v = (torch.randn(2, kv_heads, seq_k, 24, generator=generator).to(DEVICE) for _ in range(2))
    out, lse = flash._forward_op(q, k, v, causal, 1 / math.sqrt(24))
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal), atol=2e-5, rtol=2e-5)
    assert len(chosen) == 1  # the decode path ran
    splits, chunk = chosen[0]
    assert splits == math.ceil(seq_k / chunk) and (seq_k == 1 or splits > 1)


def test_decode_in_half_precision_and_its_backward():
    # The backward of a decode-path forward reads its log-sum-exp, so gradients check it too.
    for dtype in (torch.bfloat16, torch.float16):
        check_against_reference(1, 4, 2, 3, 90, 64, True, dtype)


@pytest.mark.parametrize(
    "programs, seq_k, block_n, sm_count",
    [(1, 1, 32, 132), (8, 4097, 128, 132), (2, 100, 32, 4), (4096, 4097, 64, 132), (1, 10**6, 64, 132)],
)
def test_decode_splits_cover_the_keys_in_whole_blocks(programs, seq_k, block_n, sm_count):
    splits, chunk = flash.decode_splits(programs, seq_k, block_n, sm_count)
    assert chunk % block_n == 0
    assert (splits - 1) * chunk < seq_k <= splits * chunk  # every split has keys, together all of them
    assert 1 <= splits <= flash.MAX_SPLITS
    # About two programs per multiprocessor in all, unless the keys or the cap run out first.
    assert programs * splits >= min(
        2 * sm_count, programs * math.ceil(seq_k / block_n), programs * flash.MAX_SPLITS
    )


def test_offsets_past_two_to_the_31_elements():
    # Batch row 2 starts 2^31 + 2048 elements into one buffer: 32-bit offsets would wrap and read elsewhere.
    # The buffer is reserved, not written (only the rows the views cover are), so it costs a few pages.
    stride = 2**30 + 1024
    try:
        buffer = torch.empty(2 * stride + 2048, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, torch.OutOfMemoryError):
        pytest.skip("cannot reserve 4 GiB for a tensor past 2^31 elements")
    generator = torch.Generator().manual_seed(8)
    views = [
        buffer.as_strided((3, heads, 17, 16), (stride, 17 * 16, 16, 1), at)
        for heads, at in ((2, 0), (1, 544), (1, 816))
    ]
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    q, k, v = views
    for queries in (slice(None), slice(-1, None)):  # the forward kernel, then the decode kernel
        inputs = [q[:, :, queries].requires_grad_(), k.requires_grad_(), v.requires_grad_()]
        grad = torch.randn(inputs[0].shape, generator=generator).to(DEVICE, torch.float16)
        out = flash_attention(*inputs)
        out.backward(grad)
        exact = [x.detach().double().requires_grad_() for x in inputs]
        expected = reference_attention(*exact, True)
        expected.backward(grad.double())
        atol, rtol = TOLERANCES[torch.float16]
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
        for x, x_exact in zip(inputs, exact, strict=True):
            torch.testing.assert_close(x.grad.double(), x_exact.grad, atol=atol, rtol=rtol)
            x.grad = None


def test_launch_grids_are_checked_against_cudas_limits():
    assert flash._grid(2**31 - 1, 65_535, 65_535) == (2**31 - 1, 65_535, 65_535)
    for grid in [(2**31, 1), (1, 65_536), (1, 1, 65_536)]:
        with pytest.raises(ScratchlmError, match=r"^flash_attention would launch a grid of .* past CUDA's"):
            flash._grid(*grid)
