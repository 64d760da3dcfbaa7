"""A conversation set that needs no download: small tasks a small model can learn, with exact answers.

Each conversation asks for one transformation of a short list of words or numbers and gets its one right
answer, so a reply is simply right or wrong (exact match). The words are the names of Python's built-in
functions and keywords, which every Python installation carries and which the quickstart's corpus (the
standard library's sources) is full of, so a base model trained on it already has tokens for them:

    Repeat: zip len open              ->  zip len open
    Reverse: zip len open             ->  open len zip
    Sort: 42 7 19                     ->  7 19 42
    Count the words: zip len open     ->  3
    First word: zip len open          ->  zip
    Last word: zip len open           ->  open
    As a list: zip len open           ->  ["zip", "len", "open"]
    Add 12 and 7.                     ->  19

A quarter of the conversations have a system message, and a quarter have a second exchange, so that the
answer to the last question must be found after an earlier turn. The test split is drawn from another
random stream and never repeats a training conversation's last question.
"""

from __future__ import annotations

import builtins
import keyword
import random

from scratchlm.chat.template import ChatTemplate, JinjaChatTemplate, Message
from scratchlm.generation.generate import generate
from scratchlm.model.transformer import TransformerLM

SYSTEM_PROMPTS = ("You answer exactly, with nothing else.", "Be brief.", "Reply with the answer only.")


def vocabulary() -> list[str]:
    """Lower-case names of Python's built-ins and keywords (about 150 words)."""
    names = {n for n in dir(builtins) if n.isalpha() and n.islower()} | set(keyword.kwlist)
    return sorted(n for n in names if n.isalpha() and n.islower() and 2 <= len(n) <= 10)


def _words(rng: random.Random, words: list[str]) -> list[str]:
    return rng.sample(words, rng.randint(2, 4))


def _numbers(rng: random.Random) -> list[int]:
    return rng.sample(range(100), rng.randint(2, 4))


def _task(rng: random.Random, words: list[str]) -> tuple[str, str]:
    """One question and its answer."""
    kind = rng.randrange(8)
    w = _words(rng, words)
    if kind == 0:
        return f"Repeat: {' '.join(w)}", " ".join(w)
    if kind == 1:
        return f"Reverse: {' '.join(w)}", " ".join(reversed(w))
    if kind == 2:
        n = _numbers(rng)
        return f"Sort: {' '.join(map(str, n))}", " ".join(map(str, sorted(n)))
    if kind == 3:
        return f"Count the words: {' '.join(w)}", str(len(w))
    if kind == 4:
        return f"First word: {' '.join(w)}", w[0]
    if kind == 5:
        return f"Last word: {' '.join(w)}", w[-1]
    if kind == 6:
        return f"As a list: {' '.join(w)}", "[" + ", ".join(f'"{x}"' for x in w) + "]"
    a, b = rng.randrange(20), rng.randrange(20)
    return f"Add {a} and {b}.", str(a + b)


def conversation(rng: random.Random, words: list[str]) -> list[Message]:
    """One conversation: an optional system message, an optional earlier exchange, the question asked."""
    messages = []
    if rng.random() < 0.25:
        messages.append(Message("system", rng.choice(SYSTEM_PROMPTS)))
    if rng.random() < 0.25:
        question, answer = _task(rng, words)
        messages += [Message("user", question), Message("assistant", answer)]
    question, answer = _task(rng, words)
    return [*messages, Message("user", question), Message("assistant", answer)]


def build_tasks(
    train_size: int, test_size: int, seed: int = 0
) -> tuple[list[list[Message]], list[list[Message]]]:
    """`train_size` training conversations and `test_size` test conversations, whose last questions the
    training set never asks."""
    train_rng = random.Random(f"train-{seed}")
    train = [conversation(train_rng, vocabulary()) for _ in range(train_size)]
    return train, fresh_conversations(test_size, f"test-{seed}", {messages[-2].content for messages in train})


def fresh_conversations(count: int, stream: str, asked: set[str]) -> list[list[Message]]:
    """`count` conversations from the random stream named `stream` whose last questions are none of `asked`."""
    words, rng = vocabulary(), random.Random(stream)
    found: list[list[Message]] = []
    while len(found) < count:
        messages = conversation(rng, words)
        if messages[-2].content not in asked:
            found.append(messages)
    return found


def greedy_reply(
    model: TransformerLM,
    template: ChatTemplate | JinjaChatTemplate,
    messages: list[Message],
    max_new_tokens: int | None = None,
) -> str:
    """The model's greedy answer to `messages`, up to its end of turn, `max_new_tokens` or the end of the
    context (the model runs in the dtype of its weights, under any autocast the caller has entered)."""
    prompt = template.encode(messages, add_generation_prompt=True)
    budget = max(0, model.config.context_length - len(prompt))
    if max_new_tokens is not None:
        budget = min(budget, max_new_tokens)
    answer = generate(model, prompt, max_new_tokens=budget, temperature=0, stop_ids=template.stop_ids)
    return template.tokenizer.decode([t for t in answer if t not in template.stop_ids])


def exact_match(
    model: TransformerLM, template: ChatTemplate | JinjaChatTemplate, conversations: list[list[Message]]
) -> float:
    """The share of conversations whose last assistant message the model reproduces exactly, answering the
    conversation before it greedily. A reply is cut one token past the answer's length in bytes: every token
    but the end of turn decodes to at least one byte, so a longer reply cannot be the answer, and a model that
    never ends its turn (a base model) is scored without writing to the end of its context."""
    right = 0
    for c in conversations:
        longest = len(c[-1].content.encode("utf-8")) + 1
        right += greedy_reply(model, template, c[:-1], longest) == c[-1].content
    return right / len(conversations)
