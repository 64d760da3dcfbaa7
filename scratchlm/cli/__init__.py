"""The `scratchlm` command line: one sub-command per job.

Each sub-command lives in its own module of this package, which defines `HELP` (one line), `add_arguments(parser)`
and `run(args) -> int | None`. Command modules import heavy libraries (torch, numpy) inside `run`, so that
`scratchlm --help` answers at once. A `ScratchlmError` (a user mistake) is printed as one line and exits with
status 2. Ctrl-C (SIGINT), SIGTERM (`kill`, `timeout`, `docker stop`, a scheduler) and SIGHUP (the terminal
closed, ssh dropped) all unwind the command like an exception, so partial outputs are removed and worker
processes stopped, and exit with 128 + the signal's number: 130, 143 and 129. A SIGHUP that was ignored when the
command started (`nohup`) stays ignored. Training first saves a checkpoint (see `scratchlm.training.signals`).
A console that went away (a closed pipe or terminal) is no reason to stop: see `scratchlm.console`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from scratchlm.errors import Interrupted, ScratchlmError

# command name -> module under scratchlm.cli, in the order a user meets them.
COMMANDS: dict[str, str] = {
    "quickstart": "quickstart",
    "download": "download",
    "prepare": "prepare",
    "train-tokenizer": "train_tokenizer",
    "encode": "encode",
    "train": "train",
    "sft": "sft",
    "rl": "rl",
    "eval": "eval",
    "generate": "generate",
    "chat": "chat",
    "serve": "serve",
    "export": "export",
    "import-hf": "import_hf",
    "import-gguf": "import_gguf",
    "plot": "plot",
    "sweep": "sweep",
    "accounting": "accounting",
    "doctor": "doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scratchlm",
        description="Train Transformer language models from scratch: tokenizer, model, training, generation.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"scratchlm.cli.{module_name}")
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from scratchlm.console import guarded_standard_streams

    with guarded_standard_streams():
        return _main(argv)


# The commands that train adapters (`--lora RANK`): the stages on top of a base.
LORA_COMMANDS = ("sft", "rl")


def _main(argv: list[str] | None) -> int:
    typed = list(sys.argv[1:] if argv is None else argv)  # the command as typed, for hints that repeat it
    try:
        _refuse_misplaced_lora(typed)
    except ScratchlmError as e:
        return _report(e)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = typed
    try:
        with _termination_interrupts():
            status = args._run(args)
    except ScratchlmError as e:
        return _report(e)
    except KeyboardInterrupt as e:
        print("interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    return int(status or 0)


def _report(error: ScratchlmError) -> int:
    """Print a user's mistake as one line; the exit status 2."""
    from rich.text import Text

    from scratchlm.console import console

    console.print(Text.assemble(("error:", "bold red"), f" {error}"), highlight=False, soft_wrap=True)
    return 2


def _refuse_misplaced_lora(argv: list[str]) -> None:
    """`--lora` given to a command other than `LORA_COMMANDS`, named in one line (argparse would print its usage
    and "unrecognized arguments")."""
    command = next((a for a in argv if not a.startswith("-")), None)
    given = next((a for a in argv if a == "--lora" or a.startswith("--lora=")), None)
    if given is not None and command is not None and command in COMMANDS and command not in LORA_COMMANDS:
        raise ScratchlmError(
            f"{given}: `scratchlm {command}` trains no adapters; LoRA fine-tunes a base with "
            f"`scratchlm {' or '.join(LORA_COMMANDS)} --lora RANK`"
        )


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _termination_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Interrupted` while a command runs (by default they would end the process on
    the spot, leaving temporary files and orphaned worker processes behind); a SIGHUP ignored from the start
    (`nohup`) is left ignored."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    signums = [signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signums.append(signal.SIGHUP)
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
