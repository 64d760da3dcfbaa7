"""BPE training against the reference merges, the spec's worked example, and a brute-force trainer written
here from the CS336 assignment-1 handout (recount every pair at every step), on many random corpora."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import regex
from helpers import fixture_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchlm import train_bpe
from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import merges as merges_module
from scratchlm.tokenizer.pretokenize import pretoken_counts
from scratchlm.tokenizer.serialization import load_merges, text_to_token
from scratchlm.tokenizer.train import chunk_boundaries, count_pretokens, learn_merges

# The specification's pattern, written out again here so that the oracle does not share code with the trainer.
SPEC_PATTERN = regex.compile(r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOT = "<|endoftext|>"


def spec_pretokens(text: str, special_tokens: list[str]) -> Counter[bytes]:
    """Pre-token counts by the book: split on special tokens (longest first), then the GPT-2 pattern."""
    if special_tokens:
        alternatives = sorted(special_tokens, key=len, reverse=True)
        pieces = regex.split("|".join(map(regex.escape, alternatives)), text)
    else:
        pieces = [text]
    return Counter(m.encode("utf-8") for piece in pieces for m in SPEC_PATTERN.findall(piece))


def brute_force_merges(words: Counter[bytes], num_merges: int) -> list[tuple[bytes, bytes]]:
    """The handout's algorithm literally: recount all pairs, merge the most frequent, ties to the greater pair of bytes."""
    split = {tuple(bytes([b]) for b in word): count for word, count in words.items()}
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in split.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append(best)
        merged: dict[tuple[bytes, ...], int] = {}
        for word, count in split.items():
            out: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        split = merged
    return merges


def brute_force_bpe(
    text: str, vocab_size: int, special_tokens: list[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    merges = brute_force_merges(spec_pretokens(text, special_tokens), vocab_size - 256 - len(special_tokens))
    tokens = [bytes([i]) for i in range(256)] + [a + b for a, b in merges]
    tokens += [t.encode("utf-8") for t in special_tokens]
    return dict(enumerate(tokens)), merges


def write(directory: Path, text: str | bytes, name: str = "corpus.txt") -> Path:
    path = directory / name
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


# --- the reference -------------------------------------------------------------------------------------------


def test_reference_merges_and_vocabulary() -> None:
    vocab, merges = train_bpe(fixture_path("corpus.en"), 500, [EOT])
    assert merges == load_merges(fixture_path("train-bpe-reference-merges.txt"))
    reference_vocab = json.loads(fixture_path("train-bpe-reference-vocab.json").read_text(encoding="utf-8"))
    assert set(vocab.values()) == {text_to_token(t) for t in reference_vocab}
    # Our id layout: bytes, then merges in order, then the special token.
    assert sorted(vocab) == list(range(500))
    assert all(vocab[i] == bytes([i]) for i in range(256))
    assert [vocab[256 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert vocab[499] == EOT.encode()


def test_spec_worked_example() -> None:
    """The spec's example uses whitespace pre-tokenization, so it exercises the merge core directly."""
    corpus = "low low low low low lower lower widest widest widest newest newest newest newest newest newest"
    counts = Counter(word.encode() for word in corpus.split())
    expected = "s t, e st, o w, l ow, w est, n e, ne west, w i, wi d, wid est, low e, lowe r"
    merges = learn_merges(counts, 12)
    assert [f"{a.decode()} {b.decode()}" for a, b in merges] == expected.split(", ")


def test_ties_go_to_the_lexicographically_greater_pair() -> None:
    # Every pair occurs twice; the greatest by (first, second) bytes wins each time.
    counts = Counter({b"ab": 2, b"ba": 2, b"bb": 2, b"za": 2})
    assert learn_merges(counts, 4) == [(b"z", b"a"), (b"b", b"b"), (b"b", b"a"), (b"a", b"b")]
    # A longer first part sorts after its prefix: (b"ab", b"c") > (b"a", b"bc").
    counts = Counter({b"ab": 5, b"bc": 5, b"xabc": 1, b"abcy": 1})
    merges = learn_merges(counts, 3)
    assert merges == brute_force_merges(counts, 3)


@pytest.mark.parametrize("few_places", [0, 1 << 30])
def test_every_pair_of_bytes_once(few_places: int) -> None:
    """65,536 pairs tied at one occurrence each, merged in numpy all at once or one place at a time: the
    merges are every pair, greatest first."""
    counts = Counter(bytes([x, y]) for x in range(256) for y in range(256))
    with mock.patch.object(merges_module, "FEW_PLACES", few_places):
        merges = learn_merges(counts, 256 * 256 + 1)
    assert merges == sorted(((bytes([x]), bytes([y])) for x in range(256) for y in range(256)), reverse=True)


def test_stops_early_when_no_pair_is_left(tmp_path: Path) -> None:
    path = write(tmp_path, "ab ab ab a")
    vocab, merges = train_bpe(path, 1000, [EOT])
    assert merges == [(b"a", b"b"), (b" ", b"ab"), (b" ", b"a")]  # pre-tokens: "ab", " ab" (2x), " a"
    assert len(vocab) == 256 + 3 + 1
    assert vocab[259] == EOT.encode()
    empty = write(tmp_path, "", "empty.txt")
    assert train_bpe(empty, 1000, [EOT]) == ({**{i: bytes([i]) for i in range(256)}, 256: EOT.encode()}, [])


def test_special_tokens_are_never_merged_or_counted(tmp_path: Path) -> None:
    path = write(tmp_path, f"ab{EOT}ab{EOT}{EOT}ab <|pad|>x")
    vocab, merges = train_bpe(path, 300, [EOT, "<|pad|>"])
    assert merges == [(b"a", b"b")]  # nothing in "<|endoftext|>" was counted: only "ab" (3x) and " " "x"
    assert list(vocab.values())[-2:] == [EOT.encode(), b"<|pad|>"]


def test_file_bytes_are_trained_on_exactly(tmp_path: Path) -> None:
    """No newline translation: `\\r\\n` stays two bytes and can be merged."""
    text = "one\r\n\r\ntwo\r\n\r\n" * 20
    path = write(tmp_path, text)
    vocab, merges = train_bpe(path, 270, [])
    assert (vocab, merges) == brute_force_bpe(text, 270, [])
    assert b"\r\n" in vocab.values()


def test_invalid_utf8_names_the_byte_offset(tmp_path: Path) -> None:
    data = ("hello world " * 500).encode() + b"caf\xe9 " + b"more text " * 500
    path = write(tmp_path, data)
    offset = data.index(b"\xe9")
    for workers, chunk_size in ((1, 1 << 20), (2, 1000)):
        with pytest.raises(ScratchlmError, match=f"byte offset {offset}"):
            train_bpe(path, 300, [], workers=workers, chunk_size=chunk_size)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"vocab_size": 256, "special_tokens": [EOT]}, "at least 256 bytes \\+ 1 special token"),
        ({"vocab_size": 300, "special_tokens": [""]}, "non-empty strings"),
        ({"vocab_size": 300, "special_tokens": [], "workers": 0}, "workers must be at least 1"),
    ],
)
def test_bad_arguments(tmp_path: Path, arguments: dict, message: str) -> None:
    path = write(tmp_path, "some text")
    with pytest.raises(ScratchlmError, match=message):
        train_bpe(path, **arguments)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ScratchlmError, match="not found"):
        train_bpe(tmp_path / "missing.txt", 300, [])
    with pytest.raises(ScratchlmError, match="not a regular file"):
        train_bpe(tmp_path, 300, [])


# --- parallel pre-tokenization ------------------------------------------------------------------------------


def test_result_is_the_same_for_any_number_of_workers(tmp_path: Path) -> None:
    text = fixture_path("corpus.en").read_text(encoding="utf-8")
    # Once with documents delimited by special tokens, once with none (cuts fall between a letter and a symbol).
    for name, data in (("docs.txt", EOT.join(text.split("\n\n"))), ("plain.txt", text)):
        path = write(tmp_path, data, name)
        expected = train_bpe(path, 400, [EOT], workers=1)
        for workers in (2, 3):
            assert train_bpe(path, 400, [EOT], workers=workers, chunk_size=4096) == expected


def test_chunks_are_cut_at_special_tokens(tmp_path: Path) -> None:
    documents = [f"document {i} " + "word " * (i % 37) for i in range(2000)]
    path = write(tmp_path, EOT.join(documents))
    data = path.read_bytes()
    bounds = chunk_boundaries(path, [EOT], chunk_size=1000)
    assert bounds[0] == 0 and bounds[-1] == len(data)
    assert len(bounds) > 20
    for cut in bounds[1:-1]:
        assert data[cut:].startswith(EOT.encode())
    # A chunk ends at the first special token after its nominal size: never much larger.
    assert max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) < 1000 + 300


def test_chunks_without_special_tokens_stay_small(tmp_path: Path) -> None:
    path = write(tmp_path, "Lorem ipsum, dolor sit amet. " * 10_000)
    bounds = chunk_boundaries(path, [EOT], chunk_size=5000)
    assert max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) < 5100
    assert count_pretokens(path, [EOT], workers=2, chunk_size=5000) == spec_pretokens(
        path.read_text(encoding="utf-8"), [EOT]
    )


# --- random corpora against the brute force -----------------------------------------------------------------

# Overlapping special tokens ("<s>" starts "<s>x" and sits inside "[<s>]"); "é!" also occurs inside words.
SPECIALS = [EOT, "<|pad|>", "<s>", "<s>x", "[<s>]", "é!"]
FRAGMENTS = [
    *SPECIALS,
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "\u00a0",
    "\u3000",
    "'s",
    "'ll",
    "'t",
    "'",
    "the",
    " the",
    "ab",
    "ba",
    "aaa",
    "x",
    "é",
    "ß",
    "日本",
    "🙂",
    "12",
    "7",
    "٣",
    "½",
    "!!",
    "...",
    ",",
    "\x1c",
    "\u0301",
]
corpora = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(alphabet="ab1 \n'é日", max_size=6)), max_size=60
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=corpora,
    special_tokens=st.lists(st.sampled_from(SPECIALS), unique=True, max_size=4),
    extra=st.integers(0, 40),
)
def test_matches_brute_force_on_random_corpora(text: str, special_tokens: list[str], extra: int) -> None:
    vocab_size = 256 + len(special_tokens) + extra
    with tempfile.TemporaryDirectory() as directory:
        path = write(Path(directory), text)
        assert train_bpe(path, vocab_size, special_tokens, workers=1) == brute_force_bpe(
            text, vocab_size, special_tokens
        )


@settings(max_examples=150, deadline=None)
@given(
    words=st.dictionaries(
        st.text(alphabet="ab ", min_size=1, max_size=12).map(str.encode), st.integers(1, 5)
    ),
    extra=st.integers(0, 40),
    few_places=st.sampled_from([0, 2, 1 << 30]),
)
def test_merging_in_numpy_or_in_python_matches_brute_force(
    words: dict[bytes, int], extra: int, few_places: int
) -> None:
    """Merges done all at once (numpy), one place at a time (Python), or mixed, on words full of repeated and
    overlapping pairs (`aaaa`, `abab`)."""
    with mock.patch.object(merges_module, "FEW_PLACES", few_places):
        assert learn_merges(Counter(words), extra) == brute_force_merges(Counter(words), extra)


def test_reference_merges_in_numpy_and_in_python() -> None:
    counts = count_pretokens(fixture_path("corpus.en"), [EOT])
    expected = load_merges(fixture_path("train-bpe-reference-merges.txt"))
    for few_places in (0, 1 << 30):
        with mock.patch.object(merges_module, "FEW_PLACES", few_places):
            assert learn_merges(counts, 500 - 257) == expected


@settings(max_examples=40, deadline=None)
@given(
    text=corpora,
    special_tokens=st.lists(st.sampled_from(SPECIALS), unique=True, max_size=4),
    chunk_size=st.integers(1, 40),
    workers=st.sampled_from([1, 2]),
)
def test_chunked_counts_match_whole_text_counts(
    text: str, special_tokens: list[str], chunk_size: int, workers: int
) -> None:
    """Tiny chunks put cuts everywhere a cut is allowed: the counts must not change."""
    with tempfile.TemporaryDirectory() as directory:
        path = write(Path(directory), text)
        counts = count_pretokens(path, special_tokens, workers=workers, chunk_size=chunk_size)
    assert counts == spec_pretokens(text, special_tokens)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=30) | corpora, max_size=5), st.sampled_from([1, 3, 1 << 20]))
def test_segmented_pretoken_counts_equal_the_pattern(texts: list[str], max_segments: int) -> None:
    expected = Counter(token for text in texts for token in SPEC_PATTERN.findall(text))
    assert pretoken_counts(texts, max_segments=max_segments) == expected


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_reports_reach_the_file_size(tmp_path: Path, workers: int) -> None:
    path = write(tmp_path, EOT.join(f"document {i} " * 50 for i in range(500)))
    reports: list[tuple[int, int]] = []
    count_pretokens(path, [EOT], workers=workers, chunk_size=4096, on_bytes=lambda *r: reports.append(r))
    size = path.stat().st_size
    assert reports[-1] == (size, size)
    assert all(total == size for _, total in reports)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    if workers == 1:
        assert len(reports) > 10  # once per chunk


def test_merge_core_matches_brute_force_on_long_words() -> None:
    """Repeated letters (`aaaa`, `abab`) are where incremental pair updates usually go wrong."""
    counts = Counter({b"aaaaaaa": 3, b"abababab": 2, b"aabaabaab": 4, b"baaab": 1, b"xyxyxyx": 2, b"aa": 5})
    assert learn_merges(counts, 30) == brute_force_merges(counts, 30)
    counts = Counter({b" " * 1000: 1, b"ab" * 700: 1, b"abc" * 300 + b"d": 2})
    assert learn_merges(counts, 30) == brute_force_merges(counts, 30)
