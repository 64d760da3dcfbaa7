"""Rewards: a program that scores a reply against the answer a prompt carries.

A reward is a function `(reply, answer, messages) -> float`: the reply's text (the assistant's turn, without
its end-of-turn token), the prompt's `answer`, and the conversation up to the question. Four are built in
(`REWARDS`):

    exact      1 if the reply, stripped of surrounding whitespace, is the answer, else 0
    contains   1 if the answer appears in the reply, else 0
    number     1 if the last number in the reply equals the answer's (its last number), else 0: "... so 42."
               and "42" agree, as do "1,000" and "1000.0"
    regex      1 if the answer, a regular expression, matches somewhere in the reply (`re.search`), else 0

A user's own is named `module:function` (an importable module, or a path to a `.py` file:
`rewards.py:score`). A reward that raises, runs longer than its time limit or returns something other than a
finite number (a bool counts as 0 or 1) stops the run with one line naming the function and the prompt's
`file:line` (`RewardError`); the batch it was scoring had not changed the model yet.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from scratchlm.chat.template import Message
from scratchlm.errors import ScratchlmError

Reward = Callable[[str, str, list[Message]], float]

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact(reply: str, answer: str, messages: list[Message]) -> float:
    return float(reply.strip() == answer.strip())


def contains(reply: str, answer: str, messages: list[Message]) -> float:
    return float(answer in reply)


def last_number(text: str) -> float | None:
    """The value of the last number written in `text` (thousands separators allowed), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def number(reply: str, answer: str, messages: list[Message]) -> float:
    value = last_number(reply)
    return float(value is not None and value == last_number(answer))


def regex(reply: str, answer: str, messages: list[Message]) -> float:
    return float(re.search(answer, reply) is not None)


REWARDS: dict[str, Reward] = {"exact": exact, "contains": contains, "number": number, "regex": regex}


class RewardError(ScratchlmError):
    """A reward that raised, hung or returned something other than a finite number."""


def load_reward(name: str) -> Reward:
    """The built-in reward `name`, or the function of `module:function` (a module path, or a `.py` file)."""
    if name in REWARDS:
        return REWARDS[name]
    module_name, colon, function = name.rpartition(":")
    if not colon or not module_name or not function:
        raise ScratchlmError(
            f"rl.reward {name!r} is neither a built-in reward ({', '.join(REWARDS)}) nor module:function"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ScratchlmError(f"rl.reward {name}: {path} not found")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:  # a module beside where the command runs, as `python -m` finds it
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except ScratchlmError:
        raise
    except Exception as e:  # the user's module failed to import: its own error, in one line
        raise ScratchlmError(
            f"rl.reward {name}: importing {module_name} failed: {type(e).__name__}: {e}"
        ) from None
    reward = getattr(module, function, None)
    if not callable(reward):
        raise ScratchlmError(f"rl.reward {name}: {module_name} has no function {function}")
    return reward


class _TimedOut(BaseException):
    """Raised inside a reward that ran past its limit (a BaseException: a reward's `except Exception` does not
    swallow it)."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after `seconds` with `_TimedOut` (by SIGALRM: the main thread of a Unix process;
    elsewhere the block runs without a limit)."""
    if (
        seconds <= 0
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score(
    reward: Reward, name: str, reply: str, answer: str, messages: list[Message], where: str, timeout_s: float
) -> float:
    """`reward(reply, answer, messages)` as a float, or a one-line `RewardError` naming the reward `name` and
    the prompt's `where` (file:line) when it raises, runs past `timeout_s` seconds or returns no finite
    number."""
    try:
        with _time_limit(timeout_s):
            value = reward(reply, answer, messages)
    except _TimedOut:
        raise RewardError(f"reward {name} ran longer than {timeout_s:g} s on the prompt of {where}") from None
    except Exception as e:
        message = str(e).splitlines()[0] if str(e) else ""
        raise RewardError(
            f"reward {name} raised {type(e).__name__}{': ' + message if message else ''} on the prompt of {where}"
        ) from None
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(
            f"reward {name} returned {value!r} on the prompt of {where}; a reward returns a finite number"
        )
    return float(value)
