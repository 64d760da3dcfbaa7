"""A completion's text as its tokens arrive, cut at its stop strings: the server streams it, the evaluation
harness collects it (`scratchlm.harness`)."""

from __future__ import annotations

from scratchlm.tokenizer.tokenizer import Tokenizer


class CompletionText:
    """A completion's text as its tokens arrive: whole characters, held back while a stop string may be
    starting. `offset` is where the completion starts in the choice's text (after an echoed prompt)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], offset: int) -> None:
        self.detokenizer, self.stop = tokenizer.detokenizer(), stop
        self.text, self.sent, self.offset = "", 0, offset
        self.hold = max(map(len, stop), default=1) - 1

    def add(self, token_id: int | None) -> tuple[str, bool]:
        """The text that can be sent after `token_id` (None: the end), and whether a stop string ended it."""
        final = token_id is None
        self.text += self.detokenizer.flush() if final else self.detokenizer.add(token_id)
        found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
        end = len(self.text) if found or final else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent : end], end
        return piece, bool(found)
