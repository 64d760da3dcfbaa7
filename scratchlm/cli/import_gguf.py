"""`scratchlm import-gguf FILE --out RUN_DIR`: a llama.cpp GGUF file of the Llama architecture (a scratchlm
export, or one llama.cpp's converter wrote, at any quantization the `gguf` package dequantizes) as a scratchlm
run directory in float32, which `generate`, `eval`, `export` and `train --init-from` take; its byte-level BPE
tokenizer and chat template come from the file's metadata. See scratchlm/interop/gguf_read.py."""

from __future__ import annotations

import argparse

HELP = (
    "Import a llama.cpp GGUF file (Llama architecture, byte-level BPE tokenizer; F32, F16, BF16, Q8_0, Q4_0, "
    "Q4_1, K-quants, ... dequantized to float32) as a run directory (to generate or fine-tune)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="FILE", help="the .gguf file")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to create")


def run(args: argparse.Namespace) -> None:
    from scratchlm.cli.import_hf import report
    from scratchlm.interop.gguf_read import import_gguf

    report(args.source, import_gguf(args.source, args.out))
