"""`scratchlm import-hf DIR --out RUN_DIR`: a local Hugging Face checkpoint of the Llama architecture, or one that
`scratchlm export --format hf` wrote (config.json, safetensors, and its byte-level BPE tokenizer.json), as a
scratchlm run directory, which `generate`, `eval`, `export` and `train --init-from` take; a chat model keeps its
chat template, for `chat` and `serve`. An export with its modeling code is read from its config.json, without
running the code. A `.gguf` file is handed to `import-gguf`. See scratchlm/interop/hf.py."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = (
    "Import a local Hugging Face checkpoint (Llama architecture, or a scratchlm export) as a run directory "
    "(to generate or fine-tune); a .gguf file is imported as import-gguf does."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="DIR",
        help="directory with config.json, safetensors, tokenizer.json (or a .gguf file)",
    )
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to create")


def run(args: argparse.Namespace) -> None:
    from scratchlm.interop.gguf_read import import_gguf
    from scratchlm.interop.hf import import_hf

    importer = import_gguf if Path(args.source).suffix.lower() == ".gguf" else import_hf
    report(args.source, importer(args.source, args.out))


def report(source: str, out: Path) -> None:
    """What an import wrote, and the commands that use it."""
    from scratchlm.chat.template import ChatTemplate, chat_template
    from scratchlm.console import console
    from scratchlm.run.load import load_trained

    trained = load_trained(out)
    c = trained.model.config
    attention = f"{c.num_heads} heads" + (f", {c.kv_heads} key/value heads" if c.num_kv_heads else "")
    console.print(
        f"imported {source} into {out}: {trained.model.num_parameters():,} parameters, {c.num_layers} "
        f"layers, d_model {c.d_model}, {attention}, vocabulary {c.vocab_size:,}, context {c.context_length:,}"
    )
    console.print(
        f"generate: scratchlm generate --run {out} --prompt TEXT; fine-tune: scratchlm train --config "
        f"{out}/config.toml --set data.train=FILE --set data.valid=FILE --set training.max_steps=N "
        "--set logging.run_dir=DIR"
    )
    template = chat_template(trained.tokenizer) if trained.tokenizer is not None else None
    if template is not None:
        kind = "scratchlm's" if isinstance(template, ChatTemplate) else "the model's own (Jinja)"
        console.print(f"a chat model, with {kind} chat template: scratchlm chat --run {out}")
