"""The `scratchlm` command line: one sub-command per job.

Each sub-command lives in its own module of this package, which defines `HELP` (one line), `add_arguments(parser)`
and `run(args) -> int | None`. Command modules import heavy libraries (torch, numpy) inside `run`, so that
`scratchlm --help` answers at once. A `ScratchlmError` (a user mistake) is printed as one line and exits with
status 2; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from scratchlm.errors import ScratchlmError

# command name -> module under scratchlm.cli, in the order a user meets them.
COMMANDS: dict[str, str] = {
    "quickstart": "quickstart",
    "download": "download",
    "prepare": "prepare",
    "train-tokenizer": "train_tokenizer",
    "encode": "encode",
    "train": "train",
    "eval": "eval",
    "generate": "generate",
    "plot": "plot",
    "sweep": "sweep",
    "accounting": "accounting",
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args._run(args)
    except ScratchlmError as e:
        from scratchlm.console import console

        console.print(f"[bold red]error:[/] {e}", markup=True, highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(status or 0)
