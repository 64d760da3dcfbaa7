"""Conversations for fine-tuning: read from JSONL, checked line by line, and made into batches.

The input is OpenAI's fine-tuning format, one conversation a line:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}]}

Each line is checked (`read_conversations`): JSON, a `messages` list, known roles, non-empty content, at least
one assistant turn (without one there is nothing to learn). A bad line stops the run with its file and line.

Each conversation is one row of a batch, encoded by the chat template with the tokens the loss counts
(`ChatTemplate.encode_for_training`). Rows are right-padded to the longest row of the micro-batch rather than
packed several to a row: with causal attention, padding after a conversation changes nothing before it, so
no token's loss can see another conversation, which packing would allow without an attention mask per
document. The targets of padding and of the tokens the loss does not count are `IGNORE`.

A conversation longer than the context (plus the one token whose only role is to be predicted) is cut after
its last assistant turn that fits; one whose first assistant turn does not fit is skipped. Both are counted
(`Encoded`) and reported.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from scratchlm.chat.template import ChatTemplate, Message, check_messages
from scratchlm.errors import ScratchlmError
from scratchlm.model.loss import IGNORE, cross_entropy


def read_conversations(path: str | os.PathLike) -> list[list[Message]]:
    """The conversations of a JSONL file, each line checked; blank lines are skipped."""
    conversations = []
    for where, _, messages in read_message_lines(path, "conversation"):
        if not any(m.role == "assistant" for m in messages):
            raise ScratchlmError(f"{where}: the conversation has no assistant turn, so nothing to learn from")
        conversations.append(messages)
    return conversations


def read_message_lines(path: str | os.PathLike, what: str) -> list[tuple[str, dict, list[Message]]]:
    """Each non-blank line of a JSONL file of `what`s (conversations, prompts) as its `file:line`, its JSON
    object and its checked `messages`; a line that is not such an object is a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ScratchlmError(f"{what} file {path} not found")
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise ScratchlmError(f"{path}: not valid UTF-8 at byte {e.start}") from None
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ScratchlmError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or "messages" not in record:
            raise ScratchlmError(
                f'{where}: no "messages" (expected {{"messages": [{{"role": ..., "content": ...}}]}})'
            )
        try:
            messages = check_messages(record["messages"])
        except ScratchlmError as e:
            raise ScratchlmError(f"{where}: {e}") from None
        found.append((where, record, messages))
    if not found:
        raise ScratchlmError(f"{path} holds no {what}s")
    return found


def write_conversations(path: str | os.PathLike, conversations: list[list[Message]]) -> None:
    """Write conversations as JSONL, in the format `read_conversations` reads."""
    from scratchlm.io import atomic_write

    with atomic_write(Path(path), "w") as f:
        for messages in conversations:
            record = {"messages": [{"role": m.role, "content": m.content} for m in messages]}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class Encoded:
    """Conversations encoded for fine-tuning: `ids` and `counted` (the loss counts `ids[i]` as a target)
    of conversation k at `offsets[k]:offsets[k + 1]`, and how many conversations were cut or skipped."""

    ids: np.ndarray
    counted: np.ndarray
    offsets: np.ndarray
    cut: int
    skipped: int

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        return [
            (
                self.ids[self.offsets[k] : self.offsets[k + 1]],
                self.counted[self.offsets[k] : self.offsets[k + 1]],
            )
            for k in indices
        ]


def encode_conversations(
    conversations: list[list[Message]], template: ChatTemplate, context_length: int
) -> Encoded:
    """Encode each conversation, cut or skip those longer than `context_length + 1` tokens (see the module
    docstring)."""
    ids, counted, lengths = [], [], []
    cut = skipped = 0
    for messages in conversations:
        row_ids, row_counted = template.encode_for_training(messages)
        if len(row_ids) > context_length + 1:
            row_ids, row_counted = _cut(row_ids, row_counted, template.end, context_length + 1)
            if not any(row_counted):
                skipped += 1
                continue
            cut += 1
        ids += row_ids
        counted += row_counted
        lengths.append(len(row_ids))
    if not lengths:
        raise ScratchlmError(
            f"every conversation is longer than the context ({context_length} tokens) before its first "
            "assistant turn ends"
        )
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Encoded(np.array(ids, dtype=np.int64), np.array(counted, dtype=bool), offsets, cut, skipped)


def _cut(ids: list[int], counted: list[bool], end: int, limit: int) -> tuple[list[int], list[bool]]:
    """The longest prefix of at most `limit` tokens that ends after an assistant turn (empty if none)."""
    keep = 0
    for i in range(min(len(ids), limit)):
        if ids[i] == end and counted[i]:  # an assistant turn's end
            keep = i + 1
    return ids[:keep], counted[:keep]


class ConversationBatches:
    """Fine-tuning batches: conversations drawn uniformly with replacement, one a row, the loss the
    cross-entropy of the assistant's tokens (the counterpart of `scratchlm.data.tokens.TokenWindows`; both are
    `scratchlm.training.stage.Examples`)."""

    def __init__(self, encoded: Encoded) -> None:
        self.encoded = encoded
        # Targets the loss counts per conversation (its first token is never a target).
        counted = encoded.counted.copy()
        counted[encoded.offsets[:-1]] = False
        self.counts = np.add.reduceat(counted, encoded.offsets[:-1]).astype(np.int64)
        # The inputs of a row on average (padding aside): what tokens/s counts for a fine-tuning run.
        self.tokens_per_row = float(np.diff(encoded.offsets).mean()) - 1
        self.passes = 1  # one optimizer step a batch

    def __len__(self) -> int:
        return len(self.encoded)

    def draw(self, batch_size: int, generator: np.random.Generator, policy: object = None) -> np.ndarray:
        return generator.integers(0, len(self.encoded), size=batch_size)

    def counted(self, indices: np.ndarray) -> int:
        """How many targets the loss counts in the rows of `indices`."""
        return int(self.counts[indices].sum())

    def gather(
        self, indices: np.ndarray, device: torch.device
    ) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
        """(inputs, targets) of the rows `indices`, right-padded to the longest; targets not counted are
        `IGNORE`."""
        rows = self.encoded.rows(indices)
        width = max(len(ids) for ids, _ in rows) - 1
        inputs = np.zeros((len(rows), width), dtype=np.int64)
        targets = np.full((len(rows), width), IGNORE, dtype=np.int64)
        for r, (ids, counted) in enumerate(rows):
            inputs[r, : len(ids) - 1] = ids[:-1]
            targets[r, : len(ids) - 1] = np.where(counted[1:], ids[1:], IGNORE)
        return torch.from_numpy(inputs).to(device), torch.from_numpy(targets).to(device)

    def loss(
        self, indices: np.ndarray, model: Callable[..., Tensor], device: torch.device, fused: bool
    ) -> Float[Tensor, ""]:
        """The mean cross-entropy of the counted targets of the rows `indices` (never `fused`: the fused loss
        counts every target)."""
        inputs, targets = self.gather(indices, device)
        return cross_entropy(model(inputs), targets, IGNORE)

    def validation_batches(self, iters: int, batch_size: int, seed: int) -> list[np.ndarray]:
        """The first `iters × batch_size` conversations (all, when there are fewer), in order, `batch_size` at
        a time: the same ones at every estimate, and as many rows as the time budget plans for."""
        rows = np.arange(min(len(self.encoded), iters * batch_size))
        return np.array_split(rows, max(1, math.ceil(len(rows) / batch_size)))
