"""Vocabulary and merges on disk: GPT-2's byte-to-unicode form, checked against GPT-2's own definition and HF
`tokenizers`, lossless round trips of arbitrary bytes, the fixture GPT-2 files, and malformed files."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from helpers import fixture_path
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from scratchlm.errors import ScratchlmError
from scratchlm.io import OUTPUT_MARKER
from scratchlm.tokenizer.serialization import (
    MERGES_FILE,
    SPECIAL_TOKENS_FILE,
    VOCAB_FILE,
    bytes_to_unicode,
    load_merges,
    load_tokenizer_files,
    load_vocab,
    save_tokenizer,
)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """As in OpenAI's GPT-2 `encoder.py`."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


GPT2_BYTE_OF = {c: b for b, c in gpt2_bytes_to_unicode().items()}


def gpt2_decode(text: str) -> bytes:
    return bytes(GPT2_BYTE_OF[c] for c in text)


def test_byte_mapping_is_gpt2s() -> None:
    assert bytes_to_unicode() == gpt2_bytes_to_unicode()
    assert set(bytes_to_unicode().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert bytes_to_unicode()[ord(" ")] == "Ġ" and bytes_to_unicode()[ord("\n")] == "Ċ"


token_bytes = st.binary(min_size=1, max_size=12)
special_strings = st.text(min_size=2, max_size=12).filter(lambda t: len(t.encode()) > 1)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(token_bytes, unique=True, max_size=60),
    specials=st.lists(special_strings, unique=True, max_size=3),
    merge_picks=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=40),
)
def test_round_trip_of_arbitrary_bytes(
    tokens: list[bytes], specials: list[str], merge_picks: list[tuple[int, int]]
) -> None:
    tokens = [bytes([i]) for i in range(256)] + [t for t in tokens if len(t) > 1]
    tokens += [s.encode() for s in specials if s.encode() not in tokens]
    vocab = dict(enumerate(tokens))
    merges = [(tokens[i % len(tokens)], tokens[j % len(tokens)]) for i, j in merge_picks]
    specials = [s for s in specials if s.encode() in tokens]
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "tok"
        save_tokenizer(out, vocab, merges, specials)
        assert load_tokenizer_files(out) == (vocab, merges, specials)
        # Every line of merges.txt after the header is exactly two space-free parts.
        lines = (out / MERGES_FILE).read_text(encoding="utf-8").split("\n")
        assert lines[0].startswith("#version") and lines[-1] == ""
        assert all(len(line.split(" ")) == 2 for line in lines[1:-1])


def test_fixture_gpt2_files() -> None:
    vocab_path, merges_path = fixture_path("gpt2_vocab.json"), fixture_path("gpt2_merges.txt")
    vocab = load_vocab(vocab_path)
    assert len(vocab) == 50_257 and sorted(vocab) == list(range(50_257))
    raw = json.loads(vocab_path.read_text(encoding="utf-8"))
    assert vocab == {i: gpt2_decode(t) if t != "<|endoftext|>" else t.encode() for t, i in raw.items()}
    assert vocab[50_256] == b"<|endoftext|>" and vocab[220] == b" " and vocab[198] == b"\n"

    merges = load_merges(merges_path, vocab)
    assert len(merges) == 50_000  # the fixture has no "#version" header line: its first line is a merge
    assert merges[0] == (b" ", b"t")
    assert merges == [
        tuple(gpt2_decode(p) for p in line.split(" "))
        for line in merges_path.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#version")
    ]
    tokens = set(vocab.values())
    assert all(a + b in tokens for a, b in merges)


def test_saved_files_load_in_hf_tokenizers(tmp_path: Path) -> None:
    pieces = [b"he", b"ll", b"hell", b"hello", b" w", b" wo", b" wor", b"<|endoftext|>"]
    tokens = [bytes([i]) for i in range(256)] + pieces
    merges = [
        (b"h", b"e"),
        (b"l", b"l"),
        (b"he", b"ll"),
        (b"hell", b"o"),
        (b" ", b"w"),
        (b" w", b"o"),
        (b" wo", b"r"),
    ]
    save_tokenizer(tmp_path, dict(enumerate(tokens)), merges, ["<|endoftext|>"])
    hf = HFTokenizer(models.BPE.from_file(str(tmp_path / VOCAB_FILE), str(tmp_path / MERGES_FILE)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    assert hf.get_vocab_size() == len(tokens)
    encoding = hf.encode("hello world")
    assert [tokens[i] for i in encoding.ids] == [b"hello", b" wor", b"l", b"d"]
    assert hf.decode(encoding.ids) == "hello world"


def test_saving_replaces_an_earlier_tokenizer_as_a_whole(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    vocab = {i: bytes([i]) for i in range(256)}
    save_tokenizer(out, vocab, [(b"a", b"b")], [])
    (out / "stale.txt").write_text("from an earlier run")
    save_tokenizer(out, vocab, [], [])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [VOCAB_FILE, MERGES_FILE, SPECIAL_TOKENS_FILE, OUTPUT_MARKER]
    )
    # A vocabulary that cannot be written fails before touching the existing directory.
    with pytest.raises(ScratchlmError, match="two ids, 97 and 256"):
        save_tokenizer(out, {**vocab, 256: b"a"}, [], [])
    assert load_tokenizer_files(out) == (vocab, [], [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no temporary directory left behind


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (VOCAB_FILE, '{"a": 0,\n"b": }', r"vocab.json, line 2: malformed JSON"),
        (VOCAB_FILE, '["a"]', "expected a JSON object"),
        (VOCAB_FILE, '{"a": -1}', "expected an integer ≥ 0"),
        (MERGES_FILE, "#version: 0.2\na b\na b c\n", r"merges.txt, line 3: expected two tokens"),
        (MERGES_FILE, "a z\n", "merge part 'z' is not in the vocabulary"),
        (SPECIAL_TOKENS_FILE, '[""]', "non-empty strings"),
    ],
)
def test_malformed_files(tmp_path: Path, name: str, content: str, message: str) -> None:
    save_tokenizer(tmp_path, {0: b"a", 1: b"b"}, [(b"a", b"b")], [])
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(ScratchlmError, match=message):
        load_tokenizer_files(tmp_path)


def test_missing_and_undecodable_files(tmp_path: Path) -> None:
    with pytest.raises(ScratchlmError, match="does not exist"):
        load_tokenizer_files(tmp_path / "nothing")
    with pytest.raises(ScratchlmError, match="file not found"):
        load_vocab(tmp_path / VOCAB_FILE)
    (tmp_path / VOCAB_FILE).write_bytes(b'{"\xff": 0}')
    with pytest.raises(ScratchlmError, match="not valid UTF-8 at byte 2"):
        load_vocab(tmp_path / VOCAB_FILE)
