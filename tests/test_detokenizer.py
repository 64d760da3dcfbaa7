"""`Tokenizer.detokenizer()`: token ids decoded one at a time. The oracle is Python's own one-shot decoding,
`bytes.decode("utf-8", errors="replace")` of all the tokens' bytes, on vocabularies whose tokens cut
multi-byte characters anywhere and hold bytes that are not UTF-8 at all."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from scratchlm.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def tokenizer_of(pieces: list[bytes]) -> tuple[Tokenizer, list[int]]:
    """A tokenizer whose vocabulary has every byte and each of `pieces`; the ids that spell `pieces`."""
    vocab = {b: bytes([b]) for b in range(256)}
    ids_of = {token: token_id for token_id, token in vocab.items()}
    for piece in pieces:
        if piece not in ids_of:
            ids_of[piece] = len(vocab)
            vocab[ids_of[piece]] = piece
    return Tokenizer(vocab, []), [ids_of[piece] for piece in pieces]


def streamed(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    """What `add` returned after each id, and what `flush` returned at the end."""
    detokenizer = tokenizer.detokenizer()
    return [detokenizer.add(token_id) for token_id in ids], detokenizer.flush()


@st.composite
def cut_text(draw) -> list[bytes]:
    """The UTF-8 bytes of random text (multi-byte characters of 2, 3 and 4 bytes), cut at random places,
    with random bytes slipped in (lone continuation bytes, truncated lead bytes, 0xFF...)."""
    text = draw(st.text(st.characters(codec="utf-8"), max_size=40))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(len(data) - 1, 1)), max_size=len(data))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if data[a:b]]
    for _ in range(draw(st.integers(0, 3))):
        junk = draw(st.binary(min_size=1, max_size=3))
        pieces.insert(draw(st.integers(0, len(pieces))), junk)
    return pieces


@settings(max_examples=300, deadline=None)
@given(pieces=cut_text())
def test_the_stream_is_the_one_shot_decoding_of_all_the_bytes(pieces: list[bytes]) -> None:
    tokenizer, ids = tokenizer_of(pieces)
    added, tail = streamed(tokenizer, ids)
    whole = b"".join(pieces).decode("utf-8", errors="replace")
    assert "".join(added) + tail == whole
    assert tokenizer.decode(ids) == whole


def valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(pieces=cut_text())
@example(pieces=[b"\xed\xa0", b"\x80"])  # a surrogate's first two bytes, held until the next token
def test_each_step_shows_the_text_of_its_bytes_less_an_unfinished_end(pieces: list[bytes]) -> None:
    """After k tokens, the text shown is the decoding of their bytes less the last 3 at most, the bytes of a
    character the next token may still complete; all of it once those bytes are valid UTF-8. (CPython also
    waits on a byte pair that can never become a character, such as ED A0, the start of a surrogate.)"""
    tokenizer, ids = tokenizer_of(pieces)
    added, _ = streamed(tokenizer, ids)
    whole = b"".join(pieces).decode("utf-8", errors="replace")
    shown = ""
    for k, piece in enumerate(added, start=1):
        shown += piece
        data = b"".join(pieces[:k])
        assert shown in [data[: len(data) - held].decode("utf-8", errors="replace") for held in range(4)]
        assert whole.startswith(shown)
        if valid_utf8(data):
            assert shown == data.decode("utf-8")


def test_a_character_split_over_tokens_appears_when_it_is_whole() -> None:
    # "é" is C3 A9, "日" E6 97 A5, "🙂" F0 9F 99 82; then a lone FF and a truncated "é" at the end.
    pieces = [b"a\xc3", b"\xa9", b"\xe6", b"\x97", b"\xa5b", b"\xf0\x9f", b"\x99\x82", b"\xff", b"!\xc3"]
    tokenizer, ids = tokenizer_of(pieces)
    added, tail = streamed(tokenizer, ids)
    assert added == ["a", "é", "", "", "日b", "", "🙂", REPLACEMENT, "!"]
    assert tail == REPLACEMENT


def test_an_id_outside_the_vocabulary_reads_as_a_replacement_character() -> None:
    """A model's vocabulary may be padded past its tokenizer's: such an id shows as U+FFFD, as if its bytes
    were U+FFFD's, and the stream goes on."""
    tokenizer, ids = tokenizer_of([b"x", b"\xc3", b"y"])
    unknown = tokenizer.vocab_size + 5
    added, tail = streamed(tokenizer, [ids[0], unknown, ids[1], unknown, ids[2]])
    expected = (b"x" + REPLACEMENT.encode() + b"\xc3" + REPLACEMENT.encode() + b"y").decode(errors="replace")
    assert "".join(added) + tail == expected == "x\ufffd\ufffd\ufffdy"


def test_detokenizers_are_independent() -> None:
    tokenizer, ids = tokenizer_of([b"\xc3", b"\xa9"])
    first, second = tokenizer.detokenizer(), tokenizer.detokenizer()
    assert first.add(ids[0]) == ""
    assert second.add(ids[1]) == REPLACEMENT  # a lone continuation byte: nothing of the first leaks in
    assert first.add(ids[1]) == "é"
