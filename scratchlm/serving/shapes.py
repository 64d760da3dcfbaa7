"""How the pieces of a request's choices are written: as OpenAI's completions or as its chat completions.

Both APIs run on the same `Completions` (`api.py`), which yields each choice as pieces
`{"index", "text", "logprobs", "finish_reason"}` as its tokens arrive, the last with a reason. They differ only
in how those pieces are written, which is all this module holds:

    completions   streamed: each piece as it is;        whole: one `{"index", "text", "logprobs",
                                                         "finish_reason"}` per choice
    chat          streamed: first `{"role": "assistant"}` per choice, then each piece as a `delta` of
                  `content`;                             whole: one `{"index", "message": {"role",
                                                         "content"}, "logprobs", "finish_reason"}` per choice
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

Piece = dict  # {"index", "text", "logprobs", "finish_reason"}


@dataclass(frozen=True)
class Shape:
    """One API's answer: its objects' names, and its choices written from the pieces."""

    object: str  # the whole answer's "object"
    chunk_object: str  # a streamed event's "object"
    id_prefix: str
    opening: Callable[
        [int], list[dict]
    ]  # streamed choices sent before any piece, given the number of choices
    chunk: Callable[[Piece], dict]  # a piece as a streamed choice
    choice: Callable[[list[Piece]], dict]  # a choice from all its pieces, in order

    def head(self, model_name: str, stream: bool) -> dict:
        """The fields every answer (or every event of a stream) starts with."""
        return {
            "id": f"{self.id_prefix}{uuid.uuid4().hex}",
            "object": self.chunk_object if stream else self.object,
            "created": int(time.time()),
            "model": model_name,
        }


def _merged_text(pieces: list[Piece]) -> dict:
    """A completion's choice from its pieces: the text joined, the logprobs' lists concatenated."""
    choice = {
        "index": pieces[0]["index"],
        "text": "",
        "logprobs": None,
        "finish_reason": pieces[-1]["finish_reason"],
    }
    for item in pieces:
        choice["text"] += item["text"]
        if item["logprobs"] is not None:
            if choice["logprobs"] is None:
                choice["logprobs"] = {key: [] for key in item["logprobs"]}
            for key, values in item["logprobs"].items():
                choice["logprobs"][key].extend(values)
    return choice


COMPLETION = Shape(
    object="text_completion",
    chunk_object="text_completion",
    id_prefix="cmpl-",
    opening=lambda choices: [],
    chunk=lambda piece: piece,
    choice=_merged_text,
)


def _role(index: int) -> dict:
    # OpenAI's first event of each choice: who speaks, no text yet.
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _delta(piece: Piece) -> dict:
    """A streamed chat choice: the piece's text as content. Every token sends one, even when its text is
    held back (a stop string may be starting, a character is not whole yet), so a client can count tokens;
    the last carries the reason and, like OpenAI's, may have no content."""
    delta = {"content": piece["text"]} if piece["text"] or piece["finish_reason"] is None else {}
    return {
        "index": piece["index"],
        "delta": delta,
        "logprobs": None,
        "finish_reason": piece["finish_reason"],
    }


def _message(pieces: list[Piece]) -> dict:
    return {
        "index": pieces[0]["index"],
        "message": {"role": "assistant", "content": "".join(piece["text"] for piece in pieces)},
        "logprobs": None,
        "finish_reason": pieces[-1]["finish_reason"],
    }


CHAT = Shape(
    object="chat.completion",
    chunk_object="chat.completion.chunk",
    id_prefix="chatcmpl-",
    opening=lambda choices: [_role(index) for index in range(choices)],
    chunk=_delta,
    choice=_message,
)
