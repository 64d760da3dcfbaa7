"""`scratchlm export --run DIR --format FORMAT --out PATH`: a trained model, with its tokenizer, in an export
format of the registry `EXPORT_FORMATS` (scratchlm/interop/formats.py), which gives `--format` its choices and
the help its words: this module names no format.

The configuration is checked first: the format writes the architecture of its target that computes the model
exactly, and refuses by name a feature that none of them has. With transformers installed, what was written is
loaded back by transformers and must give scratchlm's logits on a fixed input before it takes its name
(scratchlm/interop/verify.py).
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_model_source_arguments, load_model_source
from scratchlm.interop.formats import EXPORT_FORMATS

HELP = (
    "Export a trained model for "
    + " or ".join(f"{f.target} (--format {f.name})" for f in EXPORT_FORMATS.values())
    + "."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser, tokenizer=True, precision=False)
    formats = EXPORT_FORMATS.values()
    parser.add_argument(
        "--format",
        required=True,
        choices=tuple(EXPORT_FORMATS),
        help="; ".join(f"{f.name}: a {f.output}" for f in formats),
    )
    # A file format with a conventional ending is named by it: "the directory (hf) or .gguf file".
    outputs = [f"{f.suffix} {f.output}" if f.suffix else f"{f.output} ({f.name})" for f in formats]
    parser.add_argument("--out", required=True, metavar="PATH", help=f"the {' or '.join(outputs)} to write")
    parser.add_argument(
        "--dtype",
        choices=("f32", "f16", "bf16", "q8_0"),
        default="f32",
        help="weights' precision (default f32); q8_0: llama.cpp's int8 in blocks of 32 (gguf only)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: its adapters folded into its base's weights, W + (alpha/r) B A, written whole in the "
        "format (--format peft writes the adapters alone)",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.console import console
    from scratchlm.errors import ScratchlmError
    from scratchlm.interop import export_note

    chosen = EXPORT_FORMATS[args.format]
    export = chosen.build()
    trained = load_model_source(args)
    if trained.lora is None and args.merge:
        raise ScratchlmError(f"--merge: {trained.checkpoint} is not a LoRA run: it has no adapters to merge")
    if trained.lora is not None and args.merge == chosen.adapters:
        raise ScratchlmError(
            f"--format {args.format}{' --merge' if args.merge else ''}: {trained.checkpoint} is a LoRA run; "
            + ", ".join(f"--format {f.name}" for f in EXPORT_FORMATS.values() if f.adapters)
            + " writes its adapters alone, --merge with any other format the model with them merged"
        )
    result = export(trained, args.out, args.dtype)
    note = export_note(trained.model.config, result.architecture) if result.architecture else None
    if note:
        console.print(note)
    if result.max_logit_difference is None:
        checked = "not checked (transformers is not installed)"
    else:
        difference, reader = result.max_logit_difference, result.checked_by
        checked = f"logits equal to scratchlm's within {difference:.1e} (loaded by {reader})"
    console.print(f"wrote {result.path} ({result.loaded_as}, {args.dtype}); {checked}")
