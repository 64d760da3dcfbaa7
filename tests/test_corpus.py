"""The embedded corpus: whole standard-library files as documents, a held-out split that never cuts a file."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from scratchlm.data.corpus import END_OF_TEXT, build_corpus, is_validation


def test_documents_are_whole_stdlib_files_and_the_split_is_by_file(tmp_path: Path) -> None:
    corpus = build_corpus(tmp_path, max_bytes=200_000, valid_percent=10)
    train = corpus.train.read_text(encoding="utf-8").split(END_OF_TEXT)
    valid = corpus.valid.read_text(encoding="utf-8").split(END_OF_TEXT)
    assert (len(train), len(valid)) == (corpus.train_documents, corpus.valid_documents)
    assert corpus.train.stat().st_size <= 200_000 and corpus.valid.stat().st_size <= 20_000
    assert all(document.strip() for document in train + valid)

    # Read the standard library directly: every document is one file's full text, on the side its path says.
    root = Path(sysconfig.get_paths()["stdlib"])
    side_of_text = {}
    for path in sorted(root.rglob("*.py")):
        try:
            side_of_text[path.read_text(encoding="utf-8")] = is_validation(
                path.relative_to(root).as_posix(), 10
            )
        except (UnicodeDecodeError, OSError):
            continue
    assert all(side_of_text.get(document) is False for document in train)
    assert all(side_of_text.get(document) is True for document in valid)


def test_the_split_is_the_same_on_every_build(tmp_path: Path) -> None:
    first = build_corpus(tmp_path / "a", max_bytes=50_000)
    second = build_corpus(tmp_path / "b", max_bytes=50_000)
    assert first.train.read_bytes() == second.train.read_bytes()
    assert first.valid.read_bytes() == second.valid.read_bytes()
