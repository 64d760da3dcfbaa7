"""`scratchlm chat --run DIR`: a conversation with a chat model (one that `scratchlm sft` fine-tuned, or one
imported with its chat template), each answer streamed as it is produced.

At a terminal it is a conversation as a person expects one: a prompt for each message, with line editing,
`/clear` to start a new conversation (the `--system` message stays), `/exit` or Ctrl-D to quit (a line that is
one word starting with `/` is a command: `/help` lists them). Ctrl-C stops the answer being written, which
stays in the conversation as far as it got (it is what the user saw), and at the prompt discards the line
being typed; it never ends the program. SIGTERM does, as for every command.

From a pipe, each line is a message (or a command) and each answer is printed followed by a newline, with
nothing else on stdout (notices go to stderr), so `printf 'Hi\\nAnd then?\\n' | scratchlm chat --run DIR` is a
two-turn conversation that a script can read.

Every answer is generated from the whole conversation written in the model's chat template (`scratchlm.chat`):
the model sees nothing else. It ends at the template's end of turn, after `--max-new-tokens`, or where the
model's context is full. When the conversation no longer leaves room for an answer (`--max-new-tokens`, at
most half the context), its oldest exchanges (a message and its answer) are dropped, the system message kept,
and a notice says so; a message too long to fit even with no history is refused, and not kept.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TextIO

from scratchlm.cli.options import add_model_source_arguments, add_sampling_arguments, sampling_options

if TYPE_CHECKING:
    from scratchlm.chat.template import ChatTemplate, JinjaChatTemplate, Message
    from scratchlm.generation.sampling import SamplingOptions
    from scratchlm.model.transformer import TransformerLM

HELP = "Chat with a fine-tuned model at the terminal (or line by line from a pipe), its answers streamed."

PROMPT = ">>> "
COMMANDS = "/clear starts a new conversation, /exit (or Ctrl-D) quits"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser, tokenizer=True)
    add_sampling_arguments(parser)
    parser.add_argument("--system", metavar="TEXT", help="a system message that starts every conversation")


def run(args: argparse.Namespace) -> int:
    from scratchlm.chat.template import Message, chat_template
    from scratchlm.cli.options import load_for_inference
    from scratchlm.console import console
    from scratchlm.errors import ScratchlmError

    # Every option is checked before anything is loaded.
    options = answer_options(args)
    if args.system is not None and not args.system.strip():
        raise ScratchlmError("--system is empty: give the system message, or leave the option out")
    trained, _ = load_for_inference(args, require_tokenizer=True)
    source = args.run or args.checkpoint
    template = chat_template(trained.tokenizer)
    if template is None:
        raise ScratchlmError(
            f"{source} is a base model (its tokenizer has no chat template): fine-tune it to chat with "
            "`scratchlm sft` first, or use `scratchlm generate`"
        )
    system = Message("system", args.system) if args.system is not None else None
    chat = Chat(trained.model, template, options, Conversation(system))
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (importing it gives input() line editing and history)
        console.print(f"chatting with {source}: {COMMANDS}, Ctrl-C stops an answer", style="dim")
    while (line := read_message(interactive)) is not None:
        command = line.strip()
        if not command:
            continue
        if command == "/exit":
            break
        if command == "/clear":
            chat.conversation.clear()
            console.print("(a new conversation)", style="dim")
        elif command.startswith("/") and len(command.split()) == 1:  # /help, or a mistyped command
            unknown = f"unknown command {command}: " if command != "/help" else ""
            console.print(unknown + COMMANDS, style="yellow" if unknown else "dim")
        else:
            chat.reply(Message("user", line), sys.stdout)
    return 0


def answer_options(args: argparse.Namespace) -> SamplingOptions:
    """The answers' `SamplingOptions` from the command line; an answer needs a budget of one token or more."""
    from scratchlm.errors import ScratchlmError

    options = sampling_options(args)
    if options.max_new_tokens < 1:
        raise ScratchlmError(
            f"--max-new-tokens must be at least 1 for an answer, got {options.max_new_tokens}"
        )
    return options


def read_message(interactive: bool) -> str | None:
    """The next line of input without its line ending; None at the end of the input (Ctrl-D). At a terminal,
    Ctrl-C discards the line being typed and asks again, as a shell does."""
    from scratchlm.console import console
    from scratchlm.errors import Interrupted

    if not interactive:
        line = sys.stdin.readline()
        return line.removesuffix("\n") if line else None
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
        except KeyboardInterrupt as e:
            if isinstance(e, Interrupted):  # SIGTERM: the program is asked to end
                raise
            print()
            console.print(f"(Ctrl-C stops an answer; {COMMANDS})", style="dim")


@dataclass
class Conversation:
    """The messages so far: the system message, which stays, then the user's and the assistant's turns."""

    system: Message | None
    turns: list[Message] = field(default_factory=list)

    @property
    def messages(self) -> list[Message]:
        return [self.system, *self.turns] if self.system is not None else list(self.turns)

    def clear(self) -> None:
        self.turns.clear()


class TooLong(Exception):
    """A message that does not fit the context even with no history before it."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens


def fit(
    conversation: Conversation, template: ChatTemplate | JinjaChatTemplate, limit: int
) -> tuple[list[int], int]:
    """The prompt of `conversation`, whose last turn is the user's new message, at most `limit` tokens long:
    its oldest exchanges (a message and its answer) dropped, in place, until it is. Returns the prompt and how
    many exchanges were dropped; `TooLong`, with nothing dropped, when the system message and the new message
    alone are longer."""
    system = [conversation.system] if conversation.system is not None else []
    alone = template.encode([*system, conversation.turns[-1]])
    if len(alone) > limit:
        raise TooLong(len(alone))
    dropped = 0
    while len(prompt := template.encode(conversation.messages)) > limit:
        del conversation.turns[:2]
        dropped += 1
    return prompt, dropped


class StopRequest:
    """Whether Ctrl-C asked the answer to stop. A plain flag rather than a `threading.Event`, whose `set()`
    takes a lock: a second Ctrl-C can run its handler inside the first one's, which would then wait forever
    for the lock the first holds."""

    def __init__(self) -> None:
        self.requested = False

    def set(self) -> None:
        self.requested = True

    def is_set(self) -> bool:
        return self.requested


@contextlib.contextmanager
def interrupts_stop_answer() -> Iterator[StopRequest]:
    """While an answer is written, Ctrl-C (SIGINT) sets the flag that the generation loop checks after each
    token, instead of raising KeyboardInterrupt wherever the program happens to be: the answer ends at a token,
    the conversation and the program go on. A SIGINT that was ignored when the program started (`nohup`, a
    background job) stays ignored."""
    stop = StopRequest()
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None) or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


class Chat:
    """A model, its chat template, the sampling options and the conversation: `reply` answers a message."""

    def __init__(
        self,
        model: TransformerLM,
        template: ChatTemplate | JinjaChatTemplate,
        options: SamplingOptions,
        conversation: Conversation,
    ) -> None:
        from scratchlm.generation.generate import stopping_ids

        self.model, self.template, self.options, self.conversation = model, template, options, conversation
        self.stops = stopping_ids(template.tokenizer.eos_id, template.stop_ids)
        self.context = model.config.context_length
        # An answer has at least this many tokens of the context: --max-new-tokens, up to half of it.
        self.room = min(options.max_new_tokens, self.context // 2)
        # One generator for the whole conversation: with --seed, the same messages get the same answers.
        self.generator = options.generator(next(model.parameters()).device)

    def reply(self, message: Message, out: TextIO) -> None:
        """Answer `message` in the conversation, streaming the answer to `out`; notices go to stderr."""
        from scratchlm.chat.template import Message
        from scratchlm.console import console

        self.conversation.turns.append(message)
        try:
            prompt, dropped = fit(self.conversation, self.template, self.context - self.room)
        except TooLong as e:
            self.conversation.turns.pop()
            console.print(
                f"(not sent: the message is {e.tokens} tokens in the template, and the model's context of "
                f"{self.context} keeps {self.room} for the answer; write a shorter one)",
                style="yellow",
            )
            return
        if dropped:
            console.print(
                f"(the conversation outgrew the model's context of {self.context} tokens: its oldest "
                f"{dropped} exchange{'s' if dropped > 1 else ''} dropped)",
                style="yellow",
            )
        with interrupts_stop_answer() as stop:
            text, ending = self.answer(prompt, out, stop)
        self.conversation.turns.append(Message("assistant", text))
        if ending != "stop":
            console.print(f"({ending})", style="dim")

    def answer(self, prompt: list[int], out: TextIO, stop: StopRequest) -> tuple[str, str]:
        """Generate the answer to `prompt`, streamed to `out` as its characters are complete, and followed by a
        newline; returns its text (without the end-of-turn token) and, when it did not end at the end of its
        turn, what ended it."""
        from scratchlm.generation.generate import generate_stream

        budget = min(self.options.max_new_tokens, self.context - len(prompt))  # never past the context
        if budget < self.options.max_new_tokens:
            ending = f"stopped: the conversation fills the model's context of {self.context} tokens"
        else:
            ending = f"stopped after --max-new-tokens {budget}"
        text = self.template.tokenizer.detokenizer()
        pieces = []
        stream = generate_stream(
            self.model,
            prompt,
            options=replace(self.options, max_new_tokens=budget),
            stop_ids=self.stops,
            generator=self.generator,
        )
        with contextlib.closing(stream):
            for token in stream:
                if token in self.stops:
                    ending = "stop"
                    break
                pieces.append(text.add(token))
                out.write(pieces[-1])
                out.flush()
                if stop.is_set():
                    ending = "stopped"
                    break
        pieces.append(text.flush())
        out.write(pieces[-1] + "\n")
        out.flush()
        return "".join(pieces), ending
