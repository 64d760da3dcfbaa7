"""`scratchlm export --run DIR --format hf|gguf --out PATH`: a trained model, with its tokenizer, for Hugging
Face transformers (a checkpoint directory) or llama.cpp (one GGUF file).

The configuration is checked first: a feature the target's architectures lack is refused by name. With
transformers installed, what was written is loaded back by transformers and must give scratchlm's logits on
a fixed input before it takes its name (scratchlm/interop/verify.py).
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_model_source_arguments, load_model_source

HELP = "Export a trained model for Hugging Face transformers (--format hf) or llama.cpp (--format gguf)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser, tokenizer=True, precision=False)
    parser.add_argument(
        "--format", required=True, choices=("hf", "gguf"), help="hf: a directory; gguf: a file"
    )
    parser.add_argument(
        "--out", required=True, metavar="PATH", help="the directory (hf) or .gguf file to write"
    )
    parser.add_argument(
        "--dtype", choices=("f32", "f16", "bf16"), default="f32", help="weights' precision (default f32)"
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.console import console
    from scratchlm.interop import LLAMA, describe

    if args.format == "hf":
        from scratchlm.interop.hf import export_hf as export
    else:
        from scratchlm.interop.gguf import export_gguf as export

    trained = load_model_source(args)
    result = export(trained, args.out, args.dtype)
    architecture = result.architecture
    if architecture is not LLAMA:
        features = ", ".join(describe(k, v) for k, v in architecture.departures.items())
        console.print(f"{features}: written as {architecture.hf_class}, which computes the same function")
    if result.max_logit_difference is None:
        checked = "not checked (transformers is not installed)"
    else:
        checked = (
            f"logits equal to scratchlm's within {result.max_logit_difference:.1e} (loaded by transformers)"
        )
    target = architecture.hf_class if args.format == "hf" else f"llama.cpp architecture {architecture.name}"
    console.print(f"wrote {result.path} ({target}, {args.dtype}); {checked}")
