"""Options shared by several commands, defined once so that a flag means the same on every command (the table
of them is docs/cli.md): `--out`, `--minutes`, `--device`, `--precision`, `--quantize`, the trained model to
load (`--run` or `--checkpoint`: `eval`, `generate`, `chat`, `serve`, `export`), how text is sampled (`generate`, `chat`),
and the config with its repeatable `--set` for the commands that take a training config (`train`, `sft`,
`sweep`, `doctor`). On `train` and `sft`, `--out`, `--minutes`, `--device` and `--precision` set config keys
(`scratchlm.cli.train.config_flags`: the commands that train), and a mistake in one is named by its flag."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from scratchlm.device import Plan
    from scratchlm.generation.sampling import SamplingOptions
    from scratchlm.run.load import TrainedModel


def add_out_argument(
    parser: argparse.ArgumentParser,
    what: str,
    default: str | None = None,
    metavar: str = "DIR",
    required: bool = False,
    aliases: tuple[str, ...] = (),
) -> None:
    """`--out PATH`: where the command writes (`what`), its default shown in the help; `aliases` are older
    spellings that still work."""
    shown = "" if default is None or required else f" (default: {default})"
    parser.add_argument(
        "--out", *aliases, dest="out", default=default, required=required, metavar=metavar, help=what + shown
    )


def add_minutes_argument(parser: argparse.ArgumentParser, what: str, default: float | None = None) -> None:
    """`--minutes M`: the training time budget (checked by `scratchlm.training.config.budget_seconds`)."""
    shown = "" if default is None else f" (default: {default:g})"
    parser.add_argument("--minutes", type=float, default=default, metavar="M", help=what + shown)


def add_device_argument(parser: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """`--device`; `default=None` on the commands that train: the config's training.device then."""
    shown = "auto" if default == "auto" else "the config's training.device"
    parser.add_argument(
        "--device",
        default=default,
        help=f"auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps (default: {shown})",
    )


def add_precision_argument(parser: argparse.ArgumentParser, inference: bool = True) -> None:
    """`--precision`: the model's weights and KV caches (`inference`), or training.precision (default: the
    config's)."""
    from scratchlm.precisions import PRECISIONS

    auto = (
        "auto: bf16 where the device computes it natively and fast (measured), fp16 on a GPU with fast fp16 "
        "only, else fp32"
    )
    if inference:
        what = (
            "; the weights are held in it, and the KV caches on a GPU (on a CPU they are float32, what a "
            "decode step attends in) (default auto)"
        )
    else:
        what = "; bf16 and fp16 autocast the matmuls: training.precision (default: the config's)"
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="auto" if inference else None, help=auto + what
    )


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    """`--quantize SCHEME`: the model's matrices held in SCHEME for inference (`scratchlm.generation.quantize`;
    its names are repeated here so that `--help` imports no torch, and a test keeps the two equal)."""
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_SCHEMES,
        default=None,
        help="int8: the blocks' matrices and the LM head held as int8, one scale per output channel (a "
        "quarter of fp32's bytes read per token); embeddings, norms and KV caches stay in --precision "
        "(default: off)",
    )


QUANTIZE_SCHEMES = ("int8",)  # scratchlm.generation.quantize.QUANTIZE_SCHEMES


def add_model_source_arguments(
    parser: argparse.ArgumentParser, tokenizer: bool = False, precision: bool = True
) -> None:
    """`--run DIR` or `--checkpoint FILE` (exactly one) and `--device`; `--tokenizer DIR` for the commands
    that turn text into ids and back (`tokenizer`); `--precision`, `--no-compile` and `--quantize` for those
    that run the model."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="training run directory (its latest checkpoint)")
    source.add_argument("--checkpoint", metavar="FILE", help="checkpoint file (.pt)")
    if tokenizer:
        parser.add_argument(
            "--tokenizer",
            metavar="DIR",
            help="tokenizer directory (default: the run's own, else the one recorded in the training config)",
        )
    add_device_argument(parser)
    if precision:
        add_precision_argument(parser)
        parser.add_argument(
            "--no-compile",
            action="store_true",
            help="decode eagerly: never compile the one-token decode step (by default it is compiled where "
            "it measures faster and the tokens to generate pay for compiling it)",
        )
        add_quantize_argument(parser)


def inference_plan(args: argparse.Namespace, device: torch.device) -> Plan:
    """What runs the model on `device` (scratchlm.device.planning): `--precision` resolved, and the CPU thread
    count applied; a warning is printed for an explicit precision that is slow here."""
    from scratchlm.console import console
    from scratchlm.device import apply_threads, plan

    choices = plan(device, args.precision, option="--precision", compile_decode=not args.no_compile)
    apply_threads(choices.threads.value)
    for warning in choices.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)
    return choices


def load_for_inference(
    args: argparse.Namespace, require_tokenizer: bool = False
) -> tuple[TrainedModel, Plan]:
    """The model `--run` or `--checkpoint` names (`load_model_source`) with its plan, its weights held in the
    plan's precision, or its matrices in `--quantize`'s scheme (`prepare_for_inference`); the quantization
    is announced, with the bytes of the matrices before and after."""
    from scratchlm.console import console
    from scratchlm.generation.layout import prepare_for_inference
    from scratchlm.generation.quantize import describe, weight_bytes

    trained = load_model_source(args, require_tokenizer)
    device = next(trained.model.parameters()).device
    choices = inference_plan(args, device)
    quantize = getattr(args, "quantize", None)
    before = weight_bytes(trained.model, held_in=choices.dtype)
    prepare_for_inference(trained.model, choices, quantize=quantize)
    if quantize is not None:
        after = weight_bytes(trained.model)
        console.print(
            f"weights: {describe(quantize, choices)}; {after / 2**20:,.1f} MiB of matrices "
            f"instead of {before / 2**20:,.1f} MiB in {choices.precision.value}",
            style="dim",
            markup=False,
        )
    return trained, choices


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """How text is sampled, for `generate` and `chat` alike: the fields of `SamplingOptions` but `stop`."""
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="token budget per sample or answer (default 256)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)"
    )
    parser.add_argument(
        "--top-p", type=float, default=0.9, help="nucleus sampling mass in (0, 1] (default 0.9)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens only")
    parser.add_argument("--seed", type=int, default=None, help="random seed, for reproducible samples")


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    """The `SamplingOptions` of `add_sampling_arguments`' flags, an invalid one named by its flag."""
    from scratchlm.errors import ScratchlmError
    from scratchlm.generation.sampling import InvalidOption, SamplingOptions

    names = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
    try:
        return SamplingOptions(**{name: getattr(args, name) for name in names})
    except InvalidOption as e:  # named as the flag: --top-p, not top_p
        raise ScratchlmError(f"--{e.option.replace('_', '-')} {e.reason}") from None


def add_config_arguments(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The training config and its repeatable `--set` overrides: `--config FILE` and `--set KEY=VALUE` into
    `args.overrides` for `train`; a positional `CONFIG` (or `--config CONFIG`, into `args.config_option`) and
    `--set KEY=V1,V2,...` (one axis of the grid) into `args.axes` for `sweep`."""
    if sweep:
        parser.add_argument("config", nargs="?", metavar="CONFIG", help="base TOML training config")
        parser.add_argument(
            "--config", dest="config_option", metavar="CONFIG", help="the same, as a flag (as for train)"
        )
        set_help = (
            "values of one key, one run each (repeatable: the grid of all combinations); a single value "
            "overrides the key for every run"
        )
    else:
        parser.add_argument("--config", metavar="FILE", help="TOML config (e.g. configs/tiny.toml)")
        set_help = (
            "override one config key, e.g. --set optimizer.lr=3e-4 --set training.device=cpu (repeatable)"
        )
    parser.add_argument(
        "--set",
        dest="axes" if sweep else "overrides",
        metavar="SECTION.KEY=V1,V2,..." if sweep else "SECTION.KEY=VALUE",
        action="append",
        default=[],
        help=set_help,
    )


def load_model_source(args: argparse.Namespace, require_tokenizer: bool = False) -> TrainedModel:
    """The model `--run` or `--checkpoint` names, on `--device`, with its tokenizer (`--tokenizer` where the
    command has it, else the run's own; see `scratchlm.run.load_trained`), one-line error when
    `require_tokenizer` and there is none."""
    from scratchlm.device import resolve_device
    from scratchlm.errors import ScratchlmError
    from scratchlm.run.load import load_trained
    from scratchlm.run.sharded import is_sharded_checkpoint

    if args.run is not None and not Path(args.run).is_dir():
        what = "is not a directory" if Path(args.run).exists() else "not found"
        raise ScratchlmError(f"run directory {args.run} {what} (--run takes a training run directory)")
    if args.checkpoint is not None and not (
        Path(args.checkpoint).is_file() or is_sharded_checkpoint(args.checkpoint)
    ):
        what = "is not a checkpoint" if Path(args.checkpoint).exists() else "not found"
        raise ScratchlmError(
            f"checkpoint {args.checkpoint} {what} (--checkpoint takes a .pt file or a sharded checkpoint's "
            "directory)"
        )
    device = resolve_device(args.device)
    trained = load_trained(
        args.run or args.checkpoint, device=device, tokenizer=getattr(args, "tokenizer", None)
    )
    if require_tokenizer and trained.tokenizer is None:
        raise ScratchlmError(f"no tokenizer found for {trained.checkpoint}; pass --tokenizer DIR")
    return trained


def rerun_to_continue(args: argparse.Namespace) -> str:
    """The hint of a command that resumes when it runs again (`quickstart`, `sweep`), with the command as the
    user typed it."""
    import shlex

    argv = getattr(args, "argv", None)
    command = f"`scratchlm {shlex.join(argv)}`" if argv else "the same command"
    return f"rerun {command} to continue"
