"""`prepare_data` (tokenizer + encoded splits, finished steps skipped) and the dataset configs in configs/."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from scratchlm.cli import main
from scratchlm.data.prepare import VOCAB_SIZES, dataset_text_files, prepare_data
from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import DEFAULT_SPECIAL_TOKENS, END_OF_TEXT
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.serialization import load_tokenizer_files
from scratchlm.training.config import TrainConfig

PROJECT_ROOT = Path(__file__).resolve().parent.parent

STORY = (
    "Once upon a time, a little fox named Pip lived in a green forest. Pip liked to run and jump. "
    'One day, Pip found a shiny red ball near the river! "Can I play too?" asked the old owl. '
)


def write_texts(directory: Path) -> tuple[Path, Path]:
    train, valid = directory / "train.txt", directory / "valid.txt"
    train.write_text(END_OF_TEXT.join(f"{STORY} Story {i}: the end.\n" for i in range(40)), encoding="utf-8")
    valid.write_text(
        f"{STORY}{END_OF_TEXT}Pip and the owl played ball. Naïve café — ünïcödé ✓\n", encoding="utf-8"
    )
    return train, valid


def tiktoken_encoding(tokenizer_dir: Path) -> tiktoken.Encoding:
    """An independent encoder for the same vocabulary: tiktoken merges by rank, which for BPE vocabularies
    (ids in merge order) gives the same ids as applying the merges in order."""
    vocab, _, special = load_tokenizer_files(tokenizer_dir)
    token_ids = {token: i for i, token in vocab.items()}
    specials = {s: token_ids[s.encode()] for s in special}
    ranks = {token: i for token, i in token_ids.items() if i not in specials.values()}
    return tiktoken.Encoding(
        "prepared", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


def test_prepare_trains_encodes_and_skips_finished_steps(tmp_path: Path) -> None:
    train, valid = write_texts(tmp_path)
    out = tmp_path / "prepared"
    prepared = prepare_data(train, valid, out, vocab_size=300)
    vocab, merges, special = load_tokenizer_files(prepared.tokenizer)
    assert len(vocab) == 300 and len(merges) == 300 - 256 - len(DEFAULT_SPECIAL_TOKENS)
    assert special == list(DEFAULT_SPECIAL_TOKENS)  # <|endoftext|> and the chat template's, reserved

    oracle = tiktoken_encoding(prepared.tokenizer)
    for text, ids_path in ((train, prepared.train), (valid, prepared.valid)):
        ids = np.load(ids_path)
        assert ids.dtype == np.uint16
        assert ids.tolist() == oracle.encode(text.read_text(encoding="utf-8"), allowed_special="all")

    stamps = {
        p: p.stat().st_mtime_ns for p in (prepared.tokenizer / "merges.txt", prepared.train, prepared.valid)
    }
    assert prepare_data(train, valid, out, vocab_size=300) == prepared
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing was redone

    # A new tokenizer makes the old ids stale: both splits are encoded again.
    shutil.rmtree(prepared.tokenizer)
    prepared.valid.unlink()
    prepare_data(train, valid, out, vocab_size=300)
    assert prepared.train.stat().st_mtime_ns != stamps[prepared.train]
    assert np.load(prepared.valid).tolist() == oracle.encode(
        valid.read_text(encoding="utf-8"), allowed_special="all"
    )


def test_prepare_refuses_a_tokenizer_of_another_size(tmp_path: Path) -> None:
    train, valid = write_texts(tmp_path)
    prepare_data(train, valid, tmp_path / "out", vocab_size=280)
    with pytest.raises(ScratchlmError, match="is a 280-token tokenizer, not 300"):
        prepare_data(train, valid, tmp_path / "out", vocab_size=300)


def test_a_text_too_small_for_the_vocabulary_is_prepared_once(tmp_path: Path) -> None:
    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text("abc abc abd", encoding="utf-8")
    valid.write_text("abc", encoding="utf-8")
    prepared = prepare_data(train, valid, tmp_path / "out", vocab_size=1000)
    assert len(load_tokenizer_files(prepared.tokenizer)[0]) < 1000  # ran out of pairs to merge
    stamp = prepared.train.stat().st_mtime_ns
    assert prepare_data(train, valid, tmp_path / "out", vocab_size=1000) == prepared
    assert prepared.train.stat().st_mtime_ns == stamp


def test_prepare_command_on_two_files(tmp_path: Path) -> None:
    train, valid = write_texts(tmp_path)
    assert main(["prepare", str(train), str(valid), "--out", str(tmp_path / "o"), "--vocab-size", "270"]) == 0
    assert len(load_tokenizer_files(tmp_path / "o" / "tokenizer")[0]) == 270
    assert np.load(tmp_path / "o" / "valid.npy").size > 0


@pytest.mark.parametrize(
    ("config", "dataset"), [("tinystories.toml", "tinystories"), ("owt.toml", "owt-sample")]
)
def test_dataset_configs_are_the_specifications_runs(config: str, dataset: str) -> None:
    c = TrainConfig.load(PROJECT_ROOT / "configs" / config)
    m = c.model
    assert (m.vocab_size, m.context_length, m.d_model, m.d_ff, m.rope_theta) == (
        VOCAB_SIZES[dataset],
        256,
        512,
        1344,
        10_000.0,
    )
    assert (m.num_layers, m.num_heads, m.norm, m.positions, m.ffn) == (4, 16, "pre", "rope", "swiglu")
    assert c.total_steps * c.training.batch_size * m.context_length == 327_680_000
    assert (c.training.precision, c.training.compile) == ("auto", True)
    # The data paths are where `scratchlm prepare DATASET` writes (the download directory data/DATASET).
    directory = dataset_text_files(dataset, f"data/{dataset}")[0].parent
    assert (c.data.train, c.data.valid, c.data.tokenizer) == (
        str(directory / "train.npy"),
        str(directory / "valid.npy"),
        str(directory / "tokenizer"),
    )
