"""Tokenizer: ids identical to tiktoken's GPT-2 encoding, exact streaming, decoding, and clear errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from gpt2_reference import END_OF_TEXT, scratchlm_gpt2, tiktoken_gpt2
from helpers import PROJECT_ROOT, fixture_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scratchlm
from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import tokenizer as tokenizer_module
from scratchlm.tokenizer.pretokenize import PRETOKEN_RE
from scratchlm.tokenizer.serialization import save_tokenizer, token_to_text
from scratchlm.tokenizer.tokenizer import ASCII_PRETOKEN_RE, Tokenizer

DOUBLE = END_OF_TEXT + END_OF_TEXT
FIXTURE_TEXTS = [
    "tinystories_sample.txt",
    "address.txt",
    "german.txt",
    "corpus.en",
    "special_token_trailing_newlines.txt",
    "special_token_double_newlines_non_whitespace.txt",
]

# Pieces that exercise every branch of GPT-2's pattern and the places tokenizers most often disagree.
FRAGMENTS = [
    *[" ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \n ", "\u3000", "\xa0", "\x85", "\x1c", "\u2028"],
    *["'s", "'ll", "'ve", "'re", "'t", "'d", "'m", "'", "'S", "don't", "we're", " 'll"],
    *["0", "123", " 4567", "٣٤", "½", "Ⅻ", "3.14", "1,000,000"],
    *["a", "hello", " world", "É", "é", "e\u0301", "\u0301", "ß", "中文", "日本語", "Ελληνικά", "한국어"],
    *["👍", "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "\U0001f600", "!", "?!", "...", "—", "$", "\\", "\x00"],
    *["<|", "|>", "<|endoftext", "endoftext|>", "<", END_OF_TEXT, END_OF_TEXT, "\n" + END_OF_TEXT + "\n"],
]
# Only code points assigned in Python's Unicode version (no category Cn): `regex` and tiktoken each carry their
# own, newer Unicode tables, which disagree on code points assigned since (U+323B0 is a letter to one of them
# only), and such a disagreement says nothing about scratchlm. No surrogates (Cs) either, as `st.text`'s own
# default leaves them out: a str holding one is no text UTF-8 can encode.
assigned = st.characters(exclude_categories=("Cn", "Cs"))
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(assigned, max_size=6)), max_size=40).map(
    "".join
)


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return scratchlm_gpt2()


# -- parity with tiktoken ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_TEXTS)
def test_fixture_texts_encode_exactly_like_tiktoken(gpt2: Tokenizer, name: str) -> None:
    text = fixture_path(name).read_text(encoding="utf-8")
    ids = gpt2.encode(text)
    assert ids == tiktoken_gpt2().encode(text, allowed_special="all")
    assert gpt2.decode(ids) == text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_random_text_encodes_exactly_like_tiktoken(gpt2: Tokenizer, text: str) -> None:
    ids = gpt2.encode(text)
    assert ids == tiktoken_gpt2().encode(text, allowed_special="all")
    assert gpt2.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    [
        "a" * 5000,  # long pre-tokens take the heap path
        " " * 3000 + "x",
        "\n" * 1000,
        "ab" * 700 + " " + "9" * 999,
        "".join(random.Random(0).choice("abcdefghij") for _ in range(3000)),
        "\ud800",  # lone surrogates read as U+FFFD, a surrogate pair as its character, as tiktoken does
        "a\udc00b \ud83d\ude00!",
    ],
)
def test_edge_texts_encode_exactly_like_tiktoken(gpt2: Tokenizer, text: str) -> None:
    assert gpt2.encode(text) == tiktoken_gpt2().encode(text, allowed_special="all")


def test_ascii_pattern_equals_the_gpt2_pattern_on_ascii_text() -> None:
    ascii_chars = [chr(i) for i in range(128)]
    for a in ascii_chars:  # every class and every pair of neighbours, at the start and end and inside
        for b in ascii_chars:
            text = f"{a}{b} {a}{a}{b}"
            assert ASCII_PRETOKEN_RE.findall(text) == PRETOKEN_RE.findall(text)


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(
        st.sampled_from([f for f in FRAGMENTS if f.isascii()]) | st.text(st.characters(max_codepoint=127))
    ).map("".join)
)
def test_ascii_pattern_equals_the_gpt2_pattern_on_random_ascii_text(text: str) -> None:
    assert ASCII_PRETOKEN_RE.findall(text) == PRETOKEN_RE.findall(text)


def test_bounded_cache_evicts_without_changing_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "CACHE_SIZE", 50)
    small = Tokenizer(scratchlm_gpt2().vocab, scratchlm_gpt2().merges, [END_OF_TEXT])
    text = " ".join(f"word{i} x{i * 7}y" for i in range(2000)) * 2
    assert small.encode(text) == tiktoken_gpt2().encode(text)
    assert len(small._cache) <= 50


# -- special tokens --------------------------------------------------------------------------------------------


def test_overlapping_special_tokens_longest_wins() -> None:
    tok = scratchlm_gpt2(END_OF_TEXT, DOUBLE)
    double_id = tok.token_id(DOUBLE)
    assert double_id == 50257  # appended after GPT-2's 50,257 tokens
    assert tok.token_id(END_OF_TEXT) == 50256
    ordinary = tiktoken_gpt2().encode_ordinary
    text = f"Hi{DOUBLE}{END_OF_TEXT}\n{END_OF_TEXT}x{DOUBLE}"
    expected = [*ordinary("Hi"), double_id, 50256, *ordinary("\n"), 50256, *ordinary("x"), double_id]
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text


def reference_split(text: str, specials: list[str]) -> list[tuple[str, bool]]:
    """Scan left to right; at each position take the longest special token that starts there."""
    by_length = sorted(specials, key=len, reverse=True)
    parts: list[tuple[str, bool]] = []
    ordinary_start = i = 0
    while i < len(text):
        special = next((s for s in by_length if text.startswith(s, i)), None)
        if special is None:
            i += 1
            continue
        if i > ordinary_start:
            parts.append((text[ordinary_start:i], False))
        parts.append((special, True))
        i = ordinary_start = i + len(special)
    if ordinary_start < len(text):
        parts.append((text[ordinary_start:], False))
    return parts


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_overlapping_special_tokens_on_random_text(text: str) -> None:
    tok = scratchlm_gpt2(END_OF_TEXT, DOUBLE)
    ids = {END_OF_TEXT: 50256, DOUBLE: 50257}
    expected = []
    for part, special in reference_split(text, [END_OF_TEXT, DOUBLE]):
        expected.extend([ids[part]] if special else tiktoken_gpt2().encode_ordinary(part))
    assert tok.encode(text) == expected


def test_special_tokens_are_appended_once_and_named() -> None:
    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], ["<|a|>", "<|b|>", "<|a|>"])
    assert tok.special_tokens == ["<|a|>", "<|b|>"]
    assert (tok.token_id("<|a|>"), tok.token_id("<|b|>"), tok.vocab_size) == (256, 257, 258)
    assert tok.encode("x<|b|><|a|>") == [ord("x"), 257, 256]
    with pytest.raises(ScratchlmError, match="not a special token"):
        tok.token_id("<|c|>")


# -- merges ------------------------------------------------------------------------------------------------------


def random_merges(rng: random.Random, alphabet: bytes, count: int) -> list[tuple[bytes, bytes]]:
    """Merges as training makes them: each joins two tokens that exist by then."""
    tokens = [bytes([b]) for b in alphabet]
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < count:
        left, right = rng.choice(tokens), rng.choice(tokens)
        if left + right not in tokens:
            merges.append((left, right))
            tokens.append(left + right)
    return merges


def merges_in_order(word: bytes, merges: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The textbook definition: apply each merge in creation order to every occurrence, left to right."""
    parts = [bytes([b]) for b in word]
    for left, right in merges:
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and parts[i] == left and parts[i + 1] == right:
                merged.append(left + right)
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


@pytest.mark.parametrize("seed", range(5))
def test_merges_match_the_textbook_definition(seed: int) -> None:
    rng = random.Random(seed)
    merges = random_merges(rng, b"abc", 40)
    vocab = {i: bytes([i]) for i in range(256)}
    vocab |= {256 + i: left + right for i, (left, right) in enumerate(merges)}
    tok = Tokenizer(vocab, merges)
    ids_of = {token: i for i, token in vocab.items()}
    # Letters only, so each word is one pre-token; long words take the heap path.
    for length in [*range(1, 30), 200, 500]:
        word = bytes(rng.choice(b"abc") for _ in range(length))
        assert tok.encode(word.decode()) == [ids_of[p] for p in merges_in_order(word, merges)]


# -- streaming -------------------------------------------------------------------------------------------------


def cut(text: str, positions: list[int]) -> list[str]:
    bounds = [0, *sorted(p % (len(text) + 1) for p in positions), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=300, deadline=None)
@given(
    text=texts,
    positions=st.lists(st.integers(min_value=0, max_value=10**6), max_size=12),
    chunk_chars=st.integers(min_value=1, max_value=40),
)
def test_encode_iterable_equals_encode_however_the_text_is_cut(
    text: str, positions: list[int], chunk_chars: int
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizer_module, "STREAM_CHUNK_CHARS", chunk_chars)  # look for cuts all the time
        for tok in (scratchlm_gpt2(), scratchlm_gpt2(END_OF_TEXT, DOUBLE)):
            expected = tok.encode(text)
            assert list(tok.encode_iterable(cut(text, positions))) == expected
            assert list(tok.encode_iterable(list(text))) == expected  # one character at a time


@settings(max_examples=300, deadline=None)
@given(prefix=texts, suffix=texts)
def test_safe_cut_never_changes_the_encoding(prefix: str, suffix: str) -> None:
    for tok in (scratchlm_gpt2(), scratchlm_gpt2(END_OF_TEXT, DOUBLE)):
        c = tok.safe_cut(prefix)
        assert tok.encode(prefix + suffix) == tok.encode(prefix[:c]) + tok.encode(prefix[c:] + suffix)


def test_encode_iterable_streams_fixture_files(gpt2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "STREAM_CHUNK_CHARS", 100)  # many cuts even in small files
    for name in FIXTURE_TEXTS:
        path = fixture_path(name)
        with open(path, encoding="utf-8", newline="") as f:
            streamed = list(gpt2.encode_iterable(f))
        assert streamed == tiktoken_gpt2().encode(path.read_text(encoding="utf-8"), allowed_special="all")


# Run in a fresh process: stream `size` bytes of generated text through encode_iterable and report the peak
# memory (resident set) it added on top of the process as it was just before encoding.
STREAMING_CHILD = r"""
import collections, itertools, json, random, sys

sys.path.insert(0, sys.argv[1])
from gpt2_reference import scratchlm_gpt2

size = int(sys.argv[2])
rng = random.Random(0)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
LOWER = bytes(LETTERS.encode()[i % 26] for i in range(256))
# Common words (cached once), a few with capitals, digits or punctuation, and in every line five new
# 6-letter words: about 55,000 distinct pre-tokens per MB, so a pre-token cache grows with the input
# unless it is bounded.
common = [" " + "".join(rng.choices(LETTERS, k=rng.randint(1, 8))) for _ in range(4000)]
common += [" The", " A", " 42", " 2025", ",", ".", ";", " (", ")", "'s", " don't", "!"]


def lines():  # produced lazily: nothing ever holds the whole input
    produced = n = 0
    while produced < size:
        fresh = rng.randbytes(30).translate(LOWER).decode("ascii")
        line = "".join(rng.choices(common, k=10)) + "".join(" " + fresh[i : i + 6] for i in range(0, 30, 6))
        line += "<|endoftext|>" if n % 50 == 49 else ".\n"
        produced += len(line)
        n += 1
        yield line


def peak_mb():  # this process's peak resident memory (not ru_maxrss: it starts at the parent's peak)
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024  # kB


tok = scratchlm_gpt2()
baseline = peak_mb()
counter = itertools.count()
collections.deque(zip(tok.encode_iterable(lines()), counter), maxlen=0)  # counts the ids, keeps none
print(json.dumps({"tokens": next(counter), "baseline_mb": baseline, "growth_mb": peak_mb() - baseline}))
"""


def streamed_peak_growth(size: int) -> dict:
    command = [sys.executable, "-c", STREAMING_CHILD, str(PROJECT_ROOT / "tests"), str(size)]
    # glibc's malloc raises its mmap threshold to the size of the largest block freed, after which the cache's
    # dict tables (10 MB) come from the heap, where a table that does not fit the hole its predecessor left
    # extends the heap: in 8 runs of 14 this added 5 MB to the peak at 50 MB (1.5 MB in the others, 0 at 5 MB).
    # A fixed threshold keeps such blocks mapped and unmapped on their own, so that the peak counts what the
    # tokenizer holds rather than where malloc put it (no effect where there is no glibc).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="requires Linux (VmHWM in /proc/self/status)"
)
def test_encode_iterable_memory_does_not_grow_with_the_input() -> None:
    """Streaming 50 MB through encode_iterable grows peak memory by the same amount as streaming 5 MB, within
    8 MB: memory is independent of the input size.

    Each size runs in a fresh process, which reads its peak resident memory (VmHWM) with the tokenizer loaded,
    before encoding, and again after; the growth is the difference. The text is generated lazily, line by line,
    and holds about 55,000 new distinct pre-tokens per MB, so already the 5 MB run fills the bounded pre-token
    cache (`CACHE_SIZE` entries, about 20 MB) and cycles it more than once, which is the steady state. Holding
    the input would add 45 MB more at 50 MB, holding the ids over 200 MB, and an unbounded cache hundreds of MB.
    """
    small, large = streamed_peak_growth(5_000_000), streamed_peak_growth(50_000_000)
    assert large["tokens"] > 9 * small["tokens"] > 9 * 2_500_000  # both really encoded their input
    difference = large["growth_mb"] - small["growth_mb"]
    assert abs(difference) <= 8, (
        f"peak memory grew by {small['growth_mb']:.1f} MB streaming 5 MB and by {large['growth_mb']:.1f} MB"
        " streaming 50 MB"
    )


# -- decoding ----------------------------------------------------------------------------------------------------


def test_decode_replaces_malformed_utf8(gpt2: Tokenizer) -> None:
    ids_of = {token: i for i, token in gpt2.vocab.items()}
    euro = "€".encode()  # three bytes
    assert gpt2.decode([ids_of[euro[:1]], ids_of[euro[1:2]]]) == "\ufffd"  # cut short
    assert gpt2.decode([ids_of[b"a"], ids_of[b"\xff"], ids_of[b"b"]]) == "a\ufffdb"
    assert gpt2.decode([ids_of[euro[:1]], ids_of[euro[1:2]], ids_of[euro[2:]]]) == "€"


@pytest.mark.parametrize("bad_id", [50257, -1, 10**9])
def test_decode_unknown_id_is_a_value_error_naming_it(gpt2: Tokenizer, bad_id: int) -> None:
    with pytest.raises(ValueError, match=f"token id {bad_id} is not in the vocabulary"):
        gpt2.decode([31373, bad_id])


# -- files and errors --------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path) -> None:
    tok = scratchlm_gpt2(END_OF_TEXT, DOUBLE)
    tok.save(tmp_path / "tok")
    loaded = Tokenizer.from_dir(tmp_path / "tok")
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges
    assert loaded.special_tokens == [END_OF_TEXT, DOUBLE]
    text = fixture_path("tinystories_sample.txt").read_text(encoding="utf-8") + DOUBLE
    assert loaded.encode(text) == tok.encode(text)
    assert scratchlm.Tokenizer is Tokenizer


def write_tokenizer_files(directory, vocab_text: str, merges_text: str):
    directory.mkdir(exist_ok=True)
    (directory / "vocab.json").write_text(vocab_text, encoding="utf-8")
    (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    return directory / "vocab.json", directory / "merges.txt"


def byte_vocab_json(**extra: int) -> dict[str, int]:
    """A GPT-2 style vocab.json object: the 256 bytes, plus `extra` tokens (given in their mapped form)."""
    return {token_to_text(bytes([i])): i for i in range(256)} | extra


def test_missing_files_are_named(tmp_path) -> None:
    with pytest.raises(ScratchlmError, match="file not found: .*vocab.json"):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    vocab_path, _ = write_tokenizer_files(tmp_path, json.dumps(byte_vocab_json()), "")
    with pytest.raises(ScratchlmError, match="file not found: .*nope.txt"):
        Tokenizer.from_files(vocab_path, tmp_path / "nope.txt")
    with pytest.raises(ScratchlmError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "no-such-dir")


def test_malformed_vocabulary_names_file_and_line(tmp_path) -> None:
    vocab_path, merges_path = write_tokenizer_files(tmp_path, '{\n"a": 0,\n"b": oops\n}', "")
    with pytest.raises(ScratchlmError, match=r"vocab.json, line 3: malformed JSON"):
        Tokenizer.from_files(vocab_path, merges_path)


def test_malformed_merges_name_file_and_line(tmp_path) -> None:
    vocab = byte_vocab_json(ab=256)
    vocab_path, merges_path = write_tokenizer_files(tmp_path, json.dumps(vocab), "#version: 0.2\na b\nab\n")
    with pytest.raises(ScratchlmError, match=r"merges.txt, line 3: expected two tokens"):
        Tokenizer.from_files(vocab_path, merges_path)
    merges_path.write_text("a b\nab zz\n", encoding="utf-8")
    with pytest.raises(ScratchlmError, match=r"merges.txt, line 2: merge part 'zz' is not in the vocabulary"):
        Tokenizer.from_files(vocab_path, merges_path)


def test_inconsistent_merges_are_rejected(tmp_path) -> None:
    vocab = byte_vocab_json(ab=256, abc=257)
    vocab_path, merges_path = write_tokenizer_files(tmp_path, json.dumps(vocab), "a b\nb c\n")
    with pytest.raises(
        ScratchlmError, match=r"merges.txt: merge 1 \(b'b', b'c'\): the token b'bc' is not in"
    ):
        Tokenizer.from_files(vocab_path, merges_path)
    merges_path.write_text("ab c\na b\n", encoding="utf-8")
    with pytest.raises(ScratchlmError, match="b'ab' is neither a byte nor made by an earlier merge"):
        Tokenizer.from_files(vocab_path, merges_path)
    save_tokenizer(tmp_path / "dir", {i: bytes([i]) for i in range(200)}, [])
    with pytest.raises(ScratchlmError, match="lacks 56 single-byte tokens"):
        Tokenizer.from_dir(tmp_path / "dir")
    with pytest.raises(ScratchlmError, match="empty string"):
        Tokenizer({i: bytes([i]) for i in range(256)}, [], [""])


def test_eos_id_is_the_id_of_end_of_text_or_none():
    vocab = {i: bytes([i]) for i in range(256)}
    with_eos = Tokenizer(dict(vocab), [], ["<|pad|>", "<|endoftext|>"])
    assert with_eos.eos_id == with_eos.encode("<|endoftext|>")[0] == with_eos.token_id("<|endoftext|>")
    assert with_eos.eos_id != with_eos.token_id("<|pad|>")
    assert Tokenizer(dict(vocab), [], ["<|pad|>"]).eos_id is None
    assert Tokenizer(dict(vocab), []).eos_id is None


def test_every_byte_cut_of_bpe_training_is_a_cut_of_the_tokenizer():
    """Training splits files at `ASCII_LETTER_CUT_PATTERN` and the tokenizer streams text at `CUT_PATTERN`:
    the first must only find places the second allows, and each must keep the pre-tokens on both sides."""
    import regex

    from scratchlm.tokenizer.pretokenize import ASCII_LETTER_CUT_PATTERN, CUT_PATTERN, PRETOKEN_RE

    byte_cut, text_cut = regex.compile(ASCII_LETTER_CUT_PATTERN), regex.compile(CUT_PATTERN)
    found = 0
    for a in range(128):
        for b in range(128):
            pair = chr(a) + chr(b)
            if byte_cut.match(pair.encode()):
                found += 1
                assert text_cut.match(pair), repr(pair)
                text = "x" + pair + "y"
                assert PRETOKEN_RE.findall(text) == PRETOKEN_RE.findall(text[:2]) + PRETOKEN_RE.findall(
                    text[2:]
                )
    assert found == 52 * (128 - 52)  # every letter before every non-letter
