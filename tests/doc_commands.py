"""The commands a document shows, checked against the real command line without running them.

A command in a fenced code block of a Markdown file is one shell line (backslash continuations joined, `#`
comments dropped, a `$ ` prompt stripped; in a `text`, `console` or unnamed block, which mostly holds output or
directory trees, only the prompted lines are commands).
A line may chain commands with `&&`, `||`, `;`, `|` or end in `&`; each part is checked on its own:

- `scratchlm ARGS`, `python -m scratchlm ARGS` and `torchrun ... -m scratchlm ARGS` are parsed by the CLI's own
  parser (`scratchlm.cli.build_parser`), so the sub-command must exist and every flag and value must parse;
- `python PATH.py ...` must name a file of the repository.

Optional parts written in brackets, `[--top-k K]`, are documentation rather than shell: their flags must be
flags of the command, and the rest of the line is parsed without them (their values are placeholders).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from scratchlm.cli import build_parser

SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "text"}
PROMPTED_BLOCKS = {"", "console", "text"}  # output or trees, with commands only as `$ ` lines
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
OPERATORS = {"&&", "||", ";", "|", "&"}
# An optional part in brackets after a space, starting with a flag: `[--dtype f16|bf16]`.
OPTIONAL_PART = re.compile(r"(?<=\s)\[(-[^\]]*)\]")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    """One command of a document: where it is, its text, and its bracketed optional parts."""

    line: int  # 1-based line of the document where the command starts
    text: str
    optional: tuple[str, ...] = ()

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    def __str__(self) -> str:
        return f"line {self.line}: {self.text}"


def shell_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number, line) of every command line in the document's shell code blocks."""
    lines: list[tuple[int, str]] = []
    fence = None  # (marker, kind) of the open block
    pending: tuple[int, str] | None = None  # a line continued with a backslash
    for number, raw in enumerate(markdown.splitlines(), start=1):
        match = FENCE.match(raw)
        if fence is None:
            if match:
                fence = (match[2], match[3].lower())
            continue
        if match and match[2].startswith(fence[0]) and not match[3]:
            fence, pending = None, None
            continue
        kind = fence[1]
        if kind not in SHELL_BLOCKS:
            continue
        text = raw.strip()
        if pending is None:
            if kind in PROMPTED_BLOCKS:
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            elif text.startswith("$ "):
                text = text[2:]
            pending = (number, "")
        start, before = pending
        if text.endswith("\\"):
            pending = (start, before + text[:-1] + " ")
            continue
        pending = None
        lines.append((start, before + text))
    return lines


def commands(markdown: str) -> list[Command]:
    """The commands of the document's shell code blocks, each part of a chained line on its own."""
    found: list[Command] = []
    for number, line in shell_lines(markdown):
        optional = tuple(OPTIONAL_PART.findall(line))
        lexer = shlex.shlex(OPTIONAL_PART.sub(" ", line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError as e:  # an unclosed quote
            raise AssertionError(f"line {number}: cannot split {line!r}: {e}") from None
        part: list[str] = []
        redirect = False
        for token in [*tokens, ";"]:
            if token in OPERATORS:
                if part:
                    found.append(Command(number, shlex.join(part), optional))
                part = []
            elif set(token) <= set("<>&"):  # a redirection: `> log`, `2>&1` (split as 2, >&, 1)
                if part and part[-1].isdigit():
                    part.pop()
                redirect = True
            elif redirect:
                redirect = False  # its target
            else:
                part.append(token)
    return found


def scratchlm_arguments(argv: list[str]) -> list[str] | None:
    """The arguments given to scratchlm's CLI by one command, or None when it does not run the CLI."""
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    if not argv:
        return None
    if argv[0] == "scratchlm":
        return argv[1:]
    if argv[0] in ("python", "python3", "torchrun"):
        for i in range(1, len(argv) - 1):
            if argv[i] == "-m" and argv[i + 1] == "scratchlm":
                return argv[i + 2 :]
    return None


def python_script(argv: list[str]) -> str | None:
    """The script a `python PATH.py ...` command runs, or None."""
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    if len(argv) >= 2 and argv[0] in ("python", "python3") and argv[1].endswith(".py"):
        return argv[1]
    return None


def strict_parser() -> argparse.ArgumentParser:
    """scratchlm's command-line parser, refusing abbreviated flags (`--smal` for `--small`): they would run,
    but a document shows each flag by its whole name."""
    parser = build_parser()
    parser.allow_abbrev = False
    for command in _subparsers(parser).choices.values():
        command.allow_abbrev = False
    return parser


def parse_error(arguments: list[str], parser: argparse.ArgumentParser) -> str | None:
    """argparse's message when `arguments` do not parse with `parser` (nothing runs), else None."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(arguments)
    except SystemExit as e:
        if e.code != 0:  # 0: --help
            message = errors.getvalue().strip().splitlines()
            return message[-1] if message else f"exit status {e.code}"
    return None


def parse_cli(arguments: list[str]) -> argparse.Namespace:
    """`arguments` parsed by scratchlm's command-line parser without running anything; an AssertionError with
    argparse's own message when they do not parse."""
    parser = strict_parser()
    error = parse_error(arguments, parser)
    assert error is None, f"scratchlm {shlex.join(arguments)}: {error}"
    return parser.parse_args(arguments)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def check(markdown: str, root: Path) -> list[str]:
    """What is wrong with the commands of `markdown` (a document of the repository at `root`): one line each."""
    parser = strict_parser()
    problems = []
    for command in commands(markdown):
        argv = command.argv
        arguments = scratchlm_arguments(argv)
        if arguments is not None and not {"-h", "--help"} & set(arguments):
            error = parse_error(arguments, parser)
            if error is not None:
                problems.append(f"{command}: {error}")
                continue
            name = parser.parse_args(arguments).command
            flags = _subparsers(parser).choices[name]._option_string_actions
            for part in command.optional:
                for flag in (t.split("=")[0] for t in part.split() if t.startswith("-")):
                    if flag not in flags:
                        problems.append(f"{command}: scratchlm {name} has no flag {flag}")
        script = python_script(argv)
        if script is not None and not (root / script).is_file():
            problems.append(f"{command}: {script} does not exist")
    return problems
