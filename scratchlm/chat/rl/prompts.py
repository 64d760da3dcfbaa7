"""The prompts of reinforcement learning: a conversation up to the user's question and the answer a reward checks
the reply against, read from JSONL (`{"messages": [...], "answer": "..."}`), each line checked."""

from __future__ import annotations

import os
from dataclasses import dataclass

from scratchlm.chat.conversations import read_message_lines
from scratchlm.chat.template import Message
from scratchlm.errors import ScratchlmError


@dataclass(frozen=True)
class Prompt:
    """A conversation up to the question, what the reward checks the reply against, and its `file:line`."""

    messages: list[Message]
    answer: str
    where: str


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """The prompts of a JSONL file, each line checked: the conversation must end with the user's turn, and
    `answer` must be a string (or a number, read as its text)."""
    prompts = []
    for where, record, messages in read_message_lines(path, "prompt"):
        if messages[-1].role != "user":
            raise ScratchlmError(
                f"{where}: the conversation must end with the user's question, not {messages[-1].role}"
            )
        answer = record.get("answer")
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise ScratchlmError(f'{where}: no "answer" string (what the reward checks the reply against)')
        prompts.append(Prompt(messages, answer, where))
    return prompts
