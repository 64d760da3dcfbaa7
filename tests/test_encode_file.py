"""Dataset encoding: `encode_file` and `scratchlm encode` give exactly `Tokenizer.encode` of the whole file."""

from __future__ import annotations

import numpy as np
import pytest
from gpt2_reference import END_OF_TEXT, scratchlm_gpt2, tiktoken_gpt2
from helpers import fixture_path

from scratchlm.cli import main
from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import encode_file as encode_file_module
from scratchlm.tokenizer.encode_file import encode_file
from scratchlm.tokenizer.tokenizer import Tokenizer

DOUBLE = END_OF_TEXT + END_OF_TEXT


def mixed_text() -> str:
    """Every fixture text, documents joined by special tokens (some overlapping), emoji cut by block edges."""
    names = ["tinystories_sample.txt", "german.txt", "address.txt", "special_token_trailing_newlines.txt"]
    parts = [fixture_path(name).read_text(encoding="utf-8") for name in names]
    return (DOUBLE.join(parts) + "\r\n👨\u200d👩\u200d👧 héllo  \n\n" + END_OF_TEXT) * 3 + "  tail"


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny read blocks and chunks, so that a small file is cut in many places (and inside characters)."""
    monkeypatch.setattr(encode_file_module, "READ_BYTES", 7)
    monkeypatch.setattr(encode_file_module, "CHUNK_CHARS", 300)


@pytest.mark.parametrize("workers", [1, 2])
def test_encode_file_equals_encode_of_the_whole_text(tmp_path, small_blocks, workers: int) -> None:
    tok = scratchlm_gpt2(END_OF_TEXT, DOUBLE)
    text = mixed_text()
    source = tmp_path / "text.txt"
    source.write_bytes(text.encode("utf-8"))  # bytes as they are: \r\n stays \r\n
    summary = encode_file(tok, source, tmp_path / "ids.npy", workers=workers, show_progress=False)
    ids = np.load(tmp_path / "ids.npy", mmap_mode="r")
    assert ids.dtype == np.uint16 and isinstance(ids, np.memmap)
    assert ids.tolist() == tok.encode(text)
    assert summary.num_tokens == len(ids) and summary.num_bytes == len(text.encode("utf-8"))


def test_encode_cli_output_equals_tiktoken(tmp_path, capsys) -> None:
    scratchlm_gpt2().save(tmp_path / "tok")
    text = mixed_text().replace(DOUBLE, END_OF_TEXT)
    (tmp_path / "text.txt").write_bytes(text.encode("utf-8"))
    status = main(
        [
            "encode",
            str(tmp_path / "text.txt"),
            str(tmp_path / "ids.npy"),
            "--tokenizer",
            str(tmp_path / "tok"),
        ]
        + ["--workers", "2"]
    )
    assert status == 0
    ids = np.load(tmp_path / "ids.npy")
    assert ids.tolist() == tiktoken_gpt2().encode(text, allowed_special="all")
    assert f"{len(ids):,} tokens (uint16)" in capsys.readouterr().err


def test_large_vocabulary_is_stored_as_uint32(tmp_path) -> None:
    vocab = {i: bytes([i]) for i in range(256)} | {70_000: b"<|doc|>"}
    tok = Tokenizer(vocab, [], ["<|doc|>"])
    (tmp_path / "t.txt").write_text("ab<|doc|>c", encoding="utf-8")
    encode_file(tok, tmp_path / "t.txt", tmp_path / "ids.npy", workers=1, show_progress=False)
    ids = np.load(tmp_path / "ids.npy")
    assert ids.dtype == np.uint32 and ids.tolist() == [97, 98, 70_000, 99]


def test_empty_file_gives_an_empty_array(tmp_path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    summary = encode_file(scratchlm_gpt2(), tmp_path / "empty.txt", tmp_path / "ids.npy", show_progress=False)
    assert summary.num_tokens == 0 and np.load(tmp_path / "ids.npy").shape == (0,)


def test_invalid_utf8_names_the_byte(tmp_path, small_blocks) -> None:
    (tmp_path / "bad.txt").write_bytes("héllo wörld".encode() + b"\xff tail")
    with pytest.raises(ScratchlmError, match=r"bad.txt: not valid UTF-8 at byte 13 "):
        encode_file(
            scratchlm_gpt2(), tmp_path / "bad.txt", tmp_path / "ids.npy", workers=1, show_progress=False
        )
    assert not (tmp_path / "ids.npy").exists()  # no partial output, no temporary file left
    assert [p.name for p in tmp_path.iterdir()] == ["bad.txt"]


def cli_error(capsys, *args: str) -> str:
    assert main(["encode", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    return err


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path, capsys) -> None:
    scratchlm_gpt2().save(tmp_path / "tok")
    (tmp_path / "text.txt").write_text("hello", encoding="utf-8")
    (tmp_path / "file").write_text("", encoding="utf-8")
    text, tok = str(tmp_path / "text.txt"), str(tmp_path / "tok")
    assert "input file not found" in cli_error(
        capsys, str(tmp_path / "none.txt"), "o.npy", "--tokenizer", tok
    )
    assert "is a directory" in cli_error(capsys, text, str(tmp_path), "--tokenizer", tok)
    assert "does not exist" in cli_error(
        capsys, text, str(tmp_path / "o.npy"), "--tokenizer", str(tmp_path / "x")
    )
    assert "cannot create directory" in cli_error(
        capsys, text, str(tmp_path / "file" / "o.npy"), "--tokenizer", tok
    )
    (tmp_path / "tok" / "merges.txt").write_text("Ġ t\nĠt\n", encoding="utf-8")
    assert "merges.txt, line 2" in cli_error(capsys, text, str(tmp_path / "o.npy"), "--tokenizer", tok)
