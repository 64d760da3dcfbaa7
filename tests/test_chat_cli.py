"""`scratchlm chat`, run as a user runs it, with `generate` on the templated conversation as the oracle of
every answer.

- From a pipe: the greedy answers equal `generate` on `template.encode` of the whole conversation so far (the
  system message, every earlier message and answer), decoded without the end-of-turn token; `/clear` starts a
  new conversation whose answer is a fresh one's; `/exit` ends it with status 0 and reads nothing further.
- A conversation that outgrows the context drops its oldest exchanges, keeps the system message, and says so;
  a message too long for the context is refused and the conversation goes on.
- A base run (no chat template) and a bad option are one-line errors, exit status 2.
- At a terminal (a pseudo-terminal): Ctrl-C stops the answer being written and the program asks for the next
  message; at the prompt it discards the line; `/exit` then ends with status 0.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from interop_helpers import assert_one_line_error, chat_tokenizer, make_run, run_cli, scratch_model
from serve_helpers import tiny_run

from scratchlm import ModelConfig, generate, load_trained
from scratchlm.chat.template import ChatTemplate, Message
from scratchlm.cli.chat import PROMPT

TIMEOUT = 60  # seconds for any one command, which starts Python and torch
SYSTEM = "Answer briefly."
FIRST, SECOND = "Hello, café! 🙂", "Tell me\tmore  "


def chat_run(directory: Path, context: int, seed: int = 0, endless: bool = False) -> Path:
    """A run of a tiny random chat model (the small tokenizer with the chat tokens, scratchlm's template).
    `endless`: its LM head never prefers the tokens that end a turn, so a greedy answer runs to its budget."""
    tokenizer = chat_tokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, context_length=context, d_model=32, num_layers=2, num_heads=4
    )
    model = scratch_model(config, seed=seed)
    if endless:
        with torch.no_grad():  # a logit of 0 against random ones: some other token is always larger
            for stop in ChatTemplate(tokenizer).stop_ids:
                model.lm_head.weight[stop] = 0
    return make_run(directory, model, tokenizer)


def chat(run: Path, lines: list[str], *options: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `scratchlm chat` on `run`, greedy in fp32 on the CPU, given `lines`
    on a pipe."""
    done = subprocess.run(
        [sys.executable, "-m", "scratchlm", "chat", "--run", str(run), *CPU_GREEDY, *options],
        input="".join(line + "\n" for line in lines).encode(),
        capture_output=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


CPU_GREEDY = ("--device", "cpu", "--precision", "fp32", "--temperature", "0")


class Oracle:
    """`generate`'s greedy answer to a conversation, as the command is specified to give it."""

    def __init__(self, run: Path) -> None:
        trained = load_trained(run)
        self.model, self.tokenizer = trained.model, trained.tokenizer
        self.template = ChatTemplate(self.tokenizer)

    def answer(self, messages: list[Message], max_new_tokens: int) -> str:
        ids = generate(
            self.model,
            self.template.encode(messages),
            max_new_tokens,
            temperature=0,
            eos_id=self.tokenizer.eos_id,
            stop_ids=self.template.stop_ids,
        )
        if ids and ids[-1] in self.template.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """One conversation from a pipe: two messages, /clear, the second message again, /exit, one more line."""
    run = chat_run(tmp_path_factory.mktemp("chat") / "run", context=256)
    lines = [FIRST, SECOND, "/clear", SECOND, "/exit", "never answered"]
    status, out, err = chat(run, lines, "--system", SYSTEM, "--max-new-tokens", "24")
    oracle = Oracle(run)
    system, first, second = Message("system", SYSTEM), Message("user", FIRST), Message("user", SECOND)
    answer1 = oracle.answer([system, first], 24)
    answer2 = oracle.answer([system, first, Message("assistant", answer1), second], 24)
    fresh = oracle.answer([system, second], 24)
    return status, out, err, (answer1, answer2, fresh)


def test_answers_equal_generate_on_the_whole_conversation(session):
    status, out, err, (answer1, answer2, fresh) = session
    assert status == 0, err
    assert answer1 and answer2 != fresh  # the history changes the answer: the test can tell it is used
    assert out.startswith(f"{answer1}\n{answer2}\n"), (out, answer1, answer2)


def test_clear_starts_a_new_conversation_that_keeps_the_system_message(session):
    status, out, err, (answer1, answer2, fresh) = session
    assert out.removeprefix(f"{answer1}\n{answer2}\n") == f"{fresh}\n", (out, fresh)


def test_exit_ends_with_status_0_and_reads_nothing_further(session):
    status, out, err, answers = session
    assert status == 0, err
    assert out == "".join(f"{answer}\n" for answer in answers)  # no answer to the line after /exit
    assert "Traceback" not in err


def test_a_long_conversation_drops_its_oldest_exchanges_and_says_so(tmp_path):
    context, budget = 64, 8
    run = chat_run(tmp_path / "run", context=context, seed=1)
    too_long = " ".join(["word"] * 60)
    lines = ["First question", "Second one", "Third question here", too_long, "Fourth", "Fifth and last"]
    status, out, err = chat(run, lines, "--system", SYSTEM, "--max-new-tokens", str(budget))
    assert status == 0, err  # the end of the input ends the conversation

    # The rule, independently: the prompt leaves --max-new-tokens (at most half the context) for the answer.
    oracle, limit = Oracle(run), context - min(budget, context // 2)
    system, turns, expected, drops, refused = Message("system", SYSTEM), [], [], 0, 0
    for line in lines:
        message = Message("user", line)
        if len(oracle.template.encode([system, message])) > limit:
            refused += 1
            continue
        turns.append(message)
        dropped = False
        while len(oracle.template.encode([system, *turns])) > limit:
            del turns[:2]
            dropped = True
        drops += dropped
        answer = oracle.answer([system, *turns], budget)
        turns.append(Message("assistant", answer))
        expected.append(answer)
    assert drops >= 2 and refused == 1  # the test exercises both
    assert out == "".join(f"{answer}\n" for answer in expected)
    assert err.count("outgrew the model's context of 64 tokens") == drops, err
    assert err.count("not sent") == 1, err


def test_a_base_run_is_refused_in_one_line(tmp_path, capsys):
    run = tiny_run(tmp_path / "base", context=64, seed=0)
    status, _, err = run_cli(["chat", "--run", str(run), *CPU_GREEDY], capsys)
    assert_one_line_error(status, err, "base model", "no chat template", "scratchlm sft")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--system", " "], "--system is empty"),
    ],
)
def test_a_bad_option_is_refused_in_one_line_before_loading(tmp_path, capsys, option, message):
    status, _, err = run_cli(["chat", "--run", str(tmp_path / "absent"), *option], capsys)
    assert_one_line_error(status, err, message)


# -- at a terminal ---------------------------------------------------------------------------------------------


class Terminal:
    """`scratchlm chat` on a pseudo-terminal, as a person runs it: what it prints is read as it comes, and
    Ctrl-C is the byte a keyboard sends (the terminal turns it into SIGINT for the program)."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "scratchlm", "chat", *args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the command, with Ctrl-C at its default action (a test runner may ignore it)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, command, {**os.environ, "TERM": "dumb"})
        # Ctrl-C leaves the terminal's queues alone (NOFLSH). With the flush, input typed after a Ctrl-C that
        # stopped an answer was seen to vanish on a machine loaded past its cores (Linux 6.18): the program
        # waited in readline with nothing in its input queue and no SIGINT delivered, while with NOFLSH the
        # same runs (12 of 12) went through. What the program does with Ctrl-C does not depend on the flush.
        attributes = termios.tcgetattr(self.fd)
        attributes[3] |= termios.NOFLSH
        termios.tcsetattr(self.fd, termios.TCSANOW, attributes)
        self.seen = b""

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def expect(self, text: bytes, after: int = 0, timeout: float = TIMEOUT) -> int:
        """Read until `text` appears at or after offset `after`; return the offset just past it."""
        deadline = time.monotonic() + timeout
        while (found := self.seen.find(text, after)) < 0:
            self._read(deadline, f"{text!r}")
        return found + len(text)

    def read_to(self, offset: int, timeout: float = TIMEOUT) -> None:
        """Read until the terminal has shown `offset` bytes."""
        deadline = time.monotonic() + timeout
        while len(self.seen) < offset:
            self._read(deadline, f"{offset} bytes")

    def _read(self, deadline: float, awaited: str) -> None:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {awaited} in time; the terminal shows:\n{self.seen!r}"
        if select.select([self.fd], [], [], remaining)[0]:
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:  # EIO: the program has closed the terminal
                data = b""
            assert data, f"the program ended before {awaited}; the terminal shows:\n{self.seen!r}"
            self.seen += data

    def wait(self, timeout: float = TIMEOUT) -> int:
        """The exit status, once the program has ended (its output drained meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):  # EIO once the program has closed the terminal
                    self.seen += os.read(self.fd, 1 << 16)
        raise AssertionError(f"the program did not end; the terminal shows:\n{self.seen!r}")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def stop_an_answer(tmp_path) -> tuple[Terminal, int]:
    """A terminal whose first answer Ctrl-C has stopped, at the prompt that follows, and the offset past it."""
    # A greedy answer that could run for 16k tokens, many seconds, unless it is stopped.
    run = chat_run(tmp_path / "run", context=16384, endless=True)
    terminal = Terminal("--run", str(run), *CPU_GREEDY, "--max-new-tokens", "100000")
    try:
        position = terminal.expect(PROMPT.encode())
        terminal.type(b"Tell me a long story\n")
        position = terminal.expect(b"Tell me a long story\r\n", position)
        terminal.read_to(position + 200)  # the answer is being written
        terminal.type(b"\x03")
        position = terminal.expect(b"(stopped)", position)
        return terminal, terminal.expect(PROMPT.encode(), position)  # the next message is asked for
    except BaseException:
        terminal.close()
        raise


def test_ctrl_c_stops_the_answer_not_the_program(tmp_path):
    terminal, _ = stop_an_answer(tmp_path)
    assert os.waitpid(terminal.pid, os.WNOHANG) == (0, 0)  # still running, asking for the next message
    terminal.close()
    assert b"Traceback" not in terminal.seen and b"interrupted" not in terminal.seen


def test_ctrl_c_at_the_prompt_discards_the_line_and_exit_still_works(tmp_path):
    terminal, position = stop_an_answer(tmp_path)
    try:
        # At the prompt, the line typed is discarded. (A SIGINT that comes after the prompt is printed but
        # before readline waits for keys is noticed only at the next one: a person is never that quick, a
        # test can be, so it pauses, and presses again if it must.)
        time.sleep(0.5)
        terminal.type(b"half a line")
        for attempt in range(5):
            terminal.type(b"\x03")
            try:
                position = terminal.expect(b"Ctrl-C stops an answer", position, timeout=3)
                break
            except AssertionError:
                if attempt == 4:
                    raise
        position = terminal.expect(PROMPT.encode(), position)
        time.sleep(0.5)
        terminal.type(b"/exit\n")
        assert terminal.wait() == 0
        assert b"Traceback" not in terminal.seen and b"interrupted" not in terminal.seen
    finally:
        terminal.close()
