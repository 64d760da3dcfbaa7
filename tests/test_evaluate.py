"""Whole-file evaluation against the loss computed here with torch's cross-entropy over the same windows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scratchlm.errors import ScratchlmError
from scratchlm.evaluation import evaluate
from scratchlm.model.transformer import TransformerLM

VOCAB, CONTEXT = 53, 16


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(VOCAB, CONTEXT, 32, 2, 4, None).eval()


def reference_loss(model: TransformerLM, tokens: np.ndarray, context: int) -> tuple[float, int]:
    """Mean F.cross_entropy over consecutive windows of `context` inputs (the last one shorter), one by one."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):
            inputs = ids[start : min(start + context, len(ids) - 1)]
            targets = ids[start + 1 : start + 1 + len(inputs)]
            logits = model(inputs[None])[0]
            total += F.cross_entropy(logits.double(), targets, reduction="sum").item()
            count += len(targets)
    return total / count, count


@pytest.mark.parametrize(
    ("length", "batch_size", "context"),
    [(16 * 7 + 1, 3, None), (16 * 7 + 10, 2, None), (16 * 9 + 5, 64, None), (100, 4, 8), (2, 1, None)],
)
def test_perplexity_is_exp_of_mean_windowed_loss(
    model: TransformerLM, length: int, batch_size: int, context: int | None
) -> None:
    tokens = np.random.default_rng(length).integers(0, VOCAB, size=length).astype(np.uint16)
    result = evaluate(model, tokens, batch_size=batch_size, context_length=context)
    expected_loss, expected_count = reference_loss(model, tokens, context or CONTEXT)
    assert result.tokens == expected_count == length - 1
    assert result.windows == math.ceil((length - 1) / (context or CONTEXT))
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected_loss), rel=1e-5)


def test_memory_mapped_file_and_batch_size_do_not_change_the_result(
    model: TransformerLM, tmp_path: Path
) -> None:
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=300).astype(np.uint16)
    np.save(tmp_path / "valid.npy", tokens)
    mapped = np.load(tmp_path / "valid.npy", mmap_mode="r")
    results = [evaluate(model, mapped, batch_size=b).loss for b in (1, 5, 100)]
    assert results == pytest.approx([results[0]] * 3, rel=1e-6)
    assert results[0] == pytest.approx(reference_loss(model, tokens, CONTEXT)[0], rel=1e-5)


@pytest.mark.parametrize(
    ("tokens", "options", "message"),
    [
        (np.array([1], dtype=np.uint16), {}, "at least 2"),
        (np.zeros((4, 4), dtype=np.uint16), {}, "1-D"),
        (np.arange(10, dtype=np.uint16), {"context_length": CONTEXT + 1}, "context_length"),
        (np.arange(10, dtype=np.uint16), {"batch_size": 0}, "batch_size"),
        (np.array([1, 2, VOCAB, 3], dtype=np.uint16), {}, "vocabulary"),
    ],
)
def test_bad_input_is_a_user_error(
    model: TransformerLM, tokens: np.ndarray, options: dict, message: str
) -> None:
    with pytest.raises(ScratchlmError, match=message):
        evaluate(model, tokens, **options)


def test_cli_eval_prints_the_whole_file_loss(
    model: TransformerLM, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from scratchlm.cli import main
    from scratchlm.run.checkpoint import save_checkpoint
    from scratchlm.training.optim import AdamW

    save_checkpoint(
        model, AdamW(model.parameters()), 0, tmp_path / "run" / "checkpoints" / "step_00000000.pt"
    )
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=500).astype(np.uint16)
    np.save(tmp_path / "valid.npy", tokens)
    argv = [
        "eval",
        "--run",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "valid.npy"),
        "--device",
        "cpu",
        "--precision",
        "fp32",
    ]
    assert main(argv) == 0
    loss, _ = reference_loss(model, tokens, CONTEXT)
    assert capsys.readouterr().out == f"loss {loss:.4f}  perplexity {math.exp(loss):.3f}\n"
    np.save(tmp_path / "bad.npy", np.array([1, 2, VOCAB], dtype=np.uint16))
    assert main([*argv[:3], "--data", str(tmp_path / "bad.npy")]) == 2
