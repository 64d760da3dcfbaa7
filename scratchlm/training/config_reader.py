"""Reading a training config: the TOML file, `section.key=value` overrides, and the check of every value
against its section's dataclass, whose field types are the schema (`scratchlm.training.config` holds the
sections and puts a config together from what this reads).

A value is coerced to its field's type or refused with a one-line error that names the key and the type it
expects: an int is a valid float, a list a valid tuple, a Literal takes exactly its names, `X | None` takes
nothing too. An override's value is read as a TOML literal, or as a plain string when it is not one
(`training.device=cuda`), so that the command line needs no quoting for the common case.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from scratchlm.errors import ScratchlmError


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables; a one-line error naming the file when it is missing, not a file, not UTF-8 or
    not TOML."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScratchlmError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise ScratchlmError(f"config file {path} is a directory; expected a TOML file") from None
    except UnicodeDecodeError as e:
        raise ScratchlmError(
            f"config file {path} is not UTF-8 text (byte {e.start}); expected a TOML file"
        ) from None
    except OSError as e:
        raise ScratchlmError(f"config file {path} cannot be read: {e.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScratchlmError(f"config file {path} is not valid TOML: {e}") from None


def given_keys(
    path: str | os.PathLike | None,
    overrides: list[str] | tuple[str, ...] = (),
    flags: dict[str, tuple[str, Any]] | None = None,
) -> set[str]:
    """The `section.key` names a user set: in the TOML file at `path`, by a command's `flags` or by `--set`
    (what `TrainConfig.load` merges over the defaults), so that a default chosen at run time can give way."""
    given = {key for key, _ in (flags or {}).values()}
    given |= {".".join(parse_override(o)[:2]) for o in overrides}
    if path is not None:
        tables = read_toml(Path(path)).items()
        given |= {f"{s}.{k}" for s, table in tables if isinstance(table, dict) for k in table}
    return given


def parse_override(text: str) -> tuple[str, str, Any]:
    """`"optimizer.lr=3e-4"` -> ("optimizer", "lr", 0.0003); a value that is not a TOML literal is a string."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ScratchlmError(f"override {text!r} must look like section.key=value (e.g. optimizer.lr=3e-4)")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, name, value


def build_section(
    name: str, section_type: type, values: dict[str, Any], source: str, construct: bool = True
) -> Any:
    """The section `name` built from `values`, each checked against its type; `construct=False` only checks."""
    hints = typing.get_type_hints(section_type)
    known = [f.name for f in dataclasses.fields(section_type)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ScratchlmError(
            f"{source}: unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)}; "
            f"[{name}] accepts: {', '.join(known)}"
        )
    checked = {}
    for key, value in values.items():
        try:
            checked[key] = _coerce(value, hints[key])
        except TypeError:
            raise ScratchlmError(
                f"{source}: {name}.{key} must be {_type_name(hints[key])}, got {value!r}"
            ) from None
    return section_type(**checked) if construct else None  # ModelConfig checks its own ranges, naming the key


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("nothing" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        count = "" if args[-1] is Ellipsis else f"{len(args)} "
        return f"a list of {count}" + _type_name(args[0]).removeprefix("a ").removeprefix("an ") + "s"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[annotation]


def _coerce(value: Any, annotation: Any) -> Any:
    """`value` as `annotation` (an int is a valid float, a list a valid tuple), or raise TypeError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if value in args and type(value) is type(args[0]):
            return value
    elif origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is not type(None):
                try:
                    return _coerce(value, option)
                except TypeError:
                    pass
    elif origin is tuple:
        if isinstance(value, list | tuple) and args[-1] is Ellipsis:  # tuple[T, ...]: any length
            return tuple(_coerce(v, args[0]) for v in value)
        if isinstance(value, list | tuple) and len(value) == len(args):
            return tuple(_coerce(v, a) for v, a in zip(value, args, strict=True))
    elif annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, annotation):
        return value
    raise TypeError
