"""`scratchlm quickstart --text PATH`: the corpus from the user's files (documents, a held-out part chosen by
hash, clear errors for unusable files), and the whole pipeline on it with `--small` sizes."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
import torch

from scratchlm.cli import main
from scratchlm.data.corpus import build_text_corpus
from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import END_OF_TEXT

WORDS = [
    "the",
    "a",
    "fox",
    "owl",
    "river",
    "ball",
    "red",
    "green",
    "little",
    "old",
    "ran",
    "saw",
    "played",
    "found",
    "near",
    "under",
    "and",
    "then",
]


def story(rng: random.Random, sentences: int) -> str:
    return " ".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize() + "."
        for _ in range(sentences)
    )


def write_texts(root: Path, files: int = 40, documents_per_file: int = 5) -> Path:
    """A directory of `.txt` files of documents joined by <|endoftext|>, one file without the marker, and a
    hidden file that must be skipped."""
    rng = random.Random(0)
    root.mkdir()
    for i in range(files):
        docs = [story(rng, 8) for _ in range(documents_per_file)]
        (root / f"part{i:02d}.txt").write_text(END_OF_TEXT.join(docs), encoding="utf-8")
    (root / "single.txt").write_text("One whole file.\nIt has no marker at all.\n", encoding="utf-8")
    (root / ".hidden").write_text("never read", encoding="utf-8")
    return root


def documents(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split(END_OF_TEXT)


def test_documents_are_split_on_the_marker_and_held_out_by_hash(tmp_path: Path) -> None:
    texts = write_texts(tmp_path / "texts")
    corpus = build_text_corpus([texts], tmp_path / "corpus")
    train, valid = documents(corpus.train), documents(corpus.valid)
    assert len(train) + len(valid) == 40 * 5 + 1 == corpus.train_documents + corpus.valid_documents
    assert (
        "One whole file.\nIt has no marker at all.\n" in train + valid
    )  # a file without markers: one document
    assert not any("never read" in d for d in train + valid)
    assert not set(train) & set(valid)
    # the held-out documents are exactly those whose CRC-32 falls in the first 5 of 100 buckets
    assert all(zlib.crc32(d.encode()) % 100 < 5 for d in valid)
    assert all(zlib.crc32(d.encode()) % 100 >= 5 for d in train)
    assert 0.01 < len(valid) / (len(train) + len(valid)) < 0.12
    # deterministic, and independent of the order the paths are given in
    again = build_text_corpus(sorted(texts.glob("*.txt"), reverse=True), tmp_path / "again")
    assert set(documents(again.valid)) == set(valid)


def test_a_single_document_holds_out_its_last_lines(tmp_path: Path) -> None:
    lines = [f"line {i} of one long text" for i in range(100)]
    path = tmp_path / "one.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    corpus = build_text_corpus([path], tmp_path / "corpus")
    train, valid = corpus.train.read_text(encoding="utf-8"), corpus.valid.read_text(encoding="utf-8")
    assert train + valid == path.read_text(encoding="utf-8")
    assert train.endswith("\n") and valid.startswith("line ") and 3 <= valid.count("\n") <= 6


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"  \n\t\n", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "looks binary"),
        ("caf\u00e9 na\u00efve".encode("latin-1"), r"is not UTF-8 \(invalid byte at offset 3\)"),
    ],
)
def test_unusable_files_are_one_line_errors_naming_the_file(
    tmp_path: Path, content: bytes, message: str
) -> None:
    good = tmp_path / "good.txt"
    good.write_text("fine text\n" * 50, encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    with pytest.raises(ScratchlmError, match=message) as error:
        build_text_corpus([good, bad], tmp_path / "corpus")
    assert str(bad) in str(error.value) and "\n" not in str(error.value)


def test_missing_paths_and_empty_directories_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ScratchlmError, match="not found"):
        build_text_corpus([tmp_path / "missing.txt"], tmp_path / "corpus")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScratchlmError, match="has no files"):
        build_text_corpus([tmp_path / "empty"], tmp_path / "corpus")


def test_quickstart_on_your_own_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    texts = write_texts(tmp_path / "texts", files=60)
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["quickstart", "--small", "--text", str(texts), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((out / "quickstart.json").read_text())
    assert 0 < result["val_loss"] < result["unigram_entropy"]  # it learnt something from context
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r and "time" in r for r in records)
    config = (out / "run" / "config.toml").read_text()
    assert 'name = "muon"' in config and 'kind = "wsd"' in config  # the default recipe is the fast one
    train = (out / "corpus" / "train.txt").read_text(encoding="utf-8")
    assert "fox" in train and "def " not in train  # the user's text, not the standard library's

    # the same directory with another source or recipe is refused, never mixed
    capsys.readouterr()
    assert main(["quickstart", "--small", "--out", str(out)]) != 0
    assert "was built from" in capsys.readouterr().err
    assert main(["quickstart", "--small", "--text", str(texts), "--out", str(out), "--recipe", "spec"]) != 0
    assert "another recipe" in capsys.readouterr().err
