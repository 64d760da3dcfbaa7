"""`scratchlm doctor [--config FILE [--world N]] [--set KEY=VALUE ...] [--json]`: the device, what it can do,
and what scratchlm will do on it.

It prints the device (the CPU's model and the flags that matter, or the GPU's name, memory and compute
capability), the cores this process may use and how many other processes keep busy, the measured matmul
rates (fp32 and bf16, and fp16 on a GPU) and memory bandwidth, when and how they were measured (`--refresh`
measures them again), whether torch.compile works here, and the precision, thread and compile choices
`scratchlm train` makes with that config, each with its reason (`scratchlm.device.choices`), and what the
inference commands' `--quantize int8` would do here (`scratchlm.generation.quantize`). `--json` prints
the same as one JSON object, for scripts. What takes seconds (measuring the device, compiling a test
function) is announced on stderr before it starts.

`--world N` adds the config's training memory per process at N processes (`scratchlm.model.memory`):
parameters, gradients, optimizer state, communication buffers and activations under DDP and FSDP, with and
without activation checkpointing; which of them fit this device's memory (a GPU's own, one per process; a
CPU's available RAM, shared by the N processes of this machine); and the layout and number of processes it
suggests.

A config with LoRA (`lora.rank` > 0, a fine-tuning stage's) adds that run's training memory per process against
full fine-tuning's of the same model (`scratchlm.model.memory.lora_memory`), at `--world N` processes (one
without it) under DDP, with the config's activation checkpointing: each term in bytes, and the ratio of the
totals. A stage's memory is its base's model's, so for these estimates the config is made as the stage's
command makes it (`STAGE_CONFIGS`: its defaults and its base's model), which needs the base.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from scratchlm.cli.options import add_config_arguments

if TYPE_CHECKING:
    from rich.console import Console

    from scratchlm.device.profile import DeviceProfile
    from scratchlm.model.memory import MemoryBudget
    from scratchlm.training.config import TrainConfig

HELP = "Report the device, its measured speed, and the precision, threads and compilation scratchlm will use."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    flags = {
        "--json": "print one JSON object instead of a table",
        "--refresh": "measure again instead of reading this machine's cached profile",
        "--no-compile-check": "skip the trial compilation of a small function (it takes seconds to a minute)",
    }
    for flag, text in flags.items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument(
        "--world",
        type=int,
        metavar="N",
        help="also estimate the config's training memory per process at N processes, under DDP and FSDP",
    )


def run(args: argparse.Namespace) -> None:
    import json

    from scratchlm.errors import ScratchlmError
    from scratchlm.training.config import TrainConfig, training_section

    if args.world is not None and args.config is None:
        raise ScratchlmError("--world estimates a config's training memory: give --config FILE")
    if args.world is not None and args.world < 1:
        raise ScratchlmError(f"--world must be at least 1, got {args.world}")
    if args.config:
        register_stages(args.config)
    # A mistake in the config is reported before torch loads.
    config = TrainConfig.load(args.config, args.overrides) if args.config else None
    if config is not None and (args.world is not None or config.lora.rank):
        config = stage_config(args.config, args.overrides, config)
    t = config.training if config is not None else training_section(args.overrides)

    from rich.console import Console
    from rich.table import Table

    from scratchlm.console import console
    from scratchlm.device import plan, resolve_device
    from scratchlm.device.compiler import compile_works
    from scratchlm.device.decode_timings import device_timings
    from scratchlm.device.host import affinity_cpus, busy_cores, cgroup_cpu_limit, usable_cores
    from scratchlm.device.profile import measurement_note
    from scratchlm.generation.quantize import describe as describe_quantize

    device = resolve_device(t.device, option="training.device")
    peak_tflops = config.logging.peak_tflops if config is not None else 0.0
    choices = plan(device, t.precision, t.compile, t.threads, t.fused_loss, peak_tflops, refresh=args.refresh)
    profile = choices.profile
    if args.no_compile_check:
        compile_ok, compile_note = None, "not checked"
    else:
        console.print(
            "checking that torch.compile works here: compiling a small function (seconds to a minute)"
        )
        compile_ok, compile_note = compile_works(device)
    report = {
        **choices.to_dict(),
        "measurement": measurement_note(profile),
        "cores": {
            "affinity": len(affinity_cpus()),
            "cgroup_limit": cgroup_cpu_limit(),
            "usable": usable_cores(),
            "busy": round(busy_cores(), 2),
        },
        "compile_works": {"value": compile_ok, "reason": compile_note},
        "decode_timings": {shape: asdict(t) for shape, t in device_timings(device).items()},
        # What `--quantize int8` of the inference commands does here (off unless asked for).
        "quantize": "off by default; with --quantize int8 (generate, chat, serve, eval): "
        + describe_quantize("int8", choices),
    }
    if args.world is not None:
        report["memory"] = memory_report(config, args.world, choices.precision.value, memory_budget(profile))
    if config is not None and config.lora.rank:
        report["lora"] = lora_report(config, args.world or 1, choices.precision.value)
    if args.json:
        print(json.dumps(report, indent=2))
        return

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a long path wraps rather than losing its end
    table.add_row("device", f"{device} — {profile.name}")
    if profile.type == "cpu":
        table.add_row("CPU flags", " ".join(profile.flags) or "none of the relevant ones")
        table.add_row("PyTorch CPU kernels", profile.cpu_capability)
    else:
        table.add_row("GPU memory", f"{profile.gpu_memory_gib} GiB")
        table.add_row("compute capability", str(profile.compute_capability))
    table.add_row("native bf16", "yes" if profile.native_bf16 else "no")
    cores = report["cores"]
    limit = "" if cores["cgroup_limit"] is None else f", cgroup quota {cores['cgroup_limit']:g}"
    table.add_row(
        "cores", f"{cores['usable']} usable (affinity {cores['affinity']}{limit}); {cores['busy']} busy now"
    )
    rates = ", ".join(f"{name} {rate:,.1f}" for name, rate in profile.matmul_gflops.items())
    table.add_row("matmul GFLOP/s", rates)
    table.add_row("memory bandwidth", f"{profile.memory_gbps:,.1f} GB/s")
    table.add_row("measurement", report["measurement"])
    table.add_row(
        "torch.compile", ("works: " if compile_ok else "" if compile_ok is None else "fails: ") + compile_note
    )
    table.add_row("precision", f"{choices.precision.value} ({choices.precision.reason})")
    if choices.threads.value is not None:
        table.add_row("threads", f"{choices.threads.value} ({choices.threads.reason})")
    table.add_row("compile", f"{'on' if choices.compile.value else 'off'} ({choices.compile.reason})")
    table.add_row(
        "fused loss", f"{'on' if choices.fused_loss.value else 'off'} ({choices.fused_loss.reason})"
    )
    table.add_row("token × matrix", f"{choices.matvec.value} ({choices.matvec.reason})")
    table.add_row(
        "decode step", f"{'compiled' if choices.decode.value else 'eager'} ({choices.decode.reason})"
    )
    table.add_row("int8 product", f"{choices.int8_matmul.value} ({choices.int8_matmul.reason})")
    table.add_row("--quantize", report["quantize"])
    for shape, timings in device_timings(device).items():
        table.add_row("", f"measured {shape}: {timings.describe()}")
    peak = choices.peak_flops.value
    table.add_row(
        "MFU peak", f"{'' if peak is None else f'{peak / 1e12:,.1f} TFLOP/s '}({choices.peak_flops.reason})"
    )
    out = Console(highlight=False, soft_wrap=True, markup=False)
    out.print(table)  # the report, on stdout
    # 120 columns in a pipe or a file, rather than rich's 80, which would wrap the memory tables' cells
    wide = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    if args.world is not None:
        print_memory(wide, report["memory"])
    if "lora" in report:
        print_lora(wide, report["lora"])
    for warning in choices.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)


# The stages whose config sections their own modules register (`scratchlm.training.stage`), by section, with
# the function there that makes the stage's config as its command does (its defaults, its base's model).
STAGE_CONFIGS = {"sft": ("scratchlm.chat.sft", "sft_config"), "rl": ("scratchlm.chat.rl.stage", "rl_config")}


def register_stages(path: str) -> None:
    """Import the module of each stage `path` has a section of, so that its section is known."""
    import importlib
    from pathlib import Path

    from scratchlm.errors import ScratchlmError
    from scratchlm.training.config_reader import read_toml

    try:
        sections = read_toml(Path(path))
    except (ScratchlmError, OSError):
        return  # `TrainConfig.load` reports it
    for section, (module, _) in STAGE_CONFIGS.items():
        if section in sections:
            importlib.import_module(module)


def stage_config(path: str, overrides: list[str], config: TrainConfig) -> TrainConfig:
    """`config` as its stage's command makes it from `path` and `overrides`: the same for pretraining; for a
    stage on a base, with the stage's defaults and the base's model (which the memory estimates need, and
    which loading the file alone does not give)."""
    import importlib

    if config.stage_name not in STAGE_CONFIGS:
        return config
    module, function = STAGE_CONFIGS[config.stage_name]
    return getattr(importlib.import_module(module), function)(path, overrides)


def memory_budget(profile: DeviceProfile) -> MemoryBudget | None:
    """The memory a process trains in: a GPU's own (one GPU per process), or the RAM available now, which the
    processes of one machine share; None for a GPU whose size the profile does not give."""
    from scratchlm.device.host import available_ram_bytes
    from scratchlm.model.memory import MemoryBudget

    if profile.type == "cuda":
        if profile.gpu_memory_gib is None:
            return None
        return MemoryBudget(
            int(profile.gpu_memory_gib * 2**30), f"GPU memory of {profile.name}", shared=False
        )
    return MemoryBudget(available_ram_bytes(), "available RAM", shared=True)


def memory_report(
    config: TrainConfig, world: int, precision: str, budget: MemoryBudget | None
) -> dict[str, Any]:
    """The estimates at `world` processes for every layout worth comparing, whether each fits `budget`, and
    the suggested layout (`scratchlm.model.memory.suggest`), as plain values."""
    from scratchlm.model.memory import layouts, rank_memory, suggest

    t = config.training
    shape = (config.model, config.optimizer.name, precision, t.batch_size, t.grad_accum)
    rows = []
    for parallel, checkpointing in layouts(world):
        estimate = rank_memory(*shape, world, parallel, checkpointing)
        fits = None if budget is None else budget.fits(estimate)
        rows.append({**asdict(estimate), "layout": estimate.layout, "total": estimate.total, "fits": fits})
    report: dict[str, Any] = {"world": world, "precision": precision, "estimates": rows, "budget": None}
    if budget is not None:
        suggestion = suggest(*shape, world, budget)
        chosen = suggestion.estimate
        report["budget"] = asdict(budget)
        report["suggestion"] = (
            {"layout": chosen.layout, "world": chosen.world, "parallel": chosen.parallel,
             "activation_checkpointing": chosen.checkpointing, "total": chosen.total}
            if chosen is not None
            else None
        )  # fmt: skip
        report["largest_world"] = suggestion.largest_world
    return report


def lora_report(config: TrainConfig, world: int, precision: str) -> dict[str, Any]:
    """The LoRA run's estimate and full fine-tuning's, both at `world` processes under DDP (LoRA runs refuse
    FSDP) with the config's activation checkpointing, and the ratio of their totals, as plain values."""
    from scratchlm.model.memory import lora_memory, rank_memory

    t = config.training
    shape = (config.optimizer.name, precision, t.batch_size, t.grad_accum, world)
    full = rank_memory(config.model, *shape, "ddp", t.activation_checkpointing)
    lora = lora_memory(config.model, config.lora, *shape, t.activation_checkpointing)
    return {
        "layout": full.layout,
        "precision": precision,
        "rank": config.lora.rank,
        "targets": list(config.lora.targets),
        "full": {**asdict(full), "total": full.total},
        "lora": {**asdict(lora), "total": lora.total},
        "ratio": lora.total / full.total,
    }


def print_lora(out: Console, lora: dict[str, Any]) -> None:
    from rich.table import Table

    from scratchlm.cli.accounting import si

    table = Table(
        title=f"LoRA against full fine-tuning: training memory at {lora['layout']}, {lora['precision']}"
    )
    table.add_column("run")
    for column in ("parameters", "gradients", "optimizer", "activations", "total", "× full"):
        table.add_column(column, justify="right")
    full_total = lora["full"]["total"]
    names = {"full": "full fine-tuning", "lora": f"LoRA rank {lora['rank']}"}
    for key, name in names.items():
        row = lora[key]
        sizes = (row[k] for k in ("parameters", "gradients", "optimizer_state", "activations", "total"))
        table.add_row(name, *(si(size, "B") for size in sizes), f"{row['total'] / full_total:.2f}×")
    out.print(table)
    out.print(
        f"LoRA rank {lora['rank']} on {', '.join(lora['targets'])}: {lora['lora']['total']:,} bytes against full "
        f"fine-tuning's {full_total:,} ({lora['ratio']:.2f}×)"
    )
    out.print(
        "LoRA's frozen base: weights only; its adapters: float32, with gradients and AdamW's moments; not "
        "counted: embedding tables a stage grows for chat tokens, which train too"
    )


def print_memory(out: Console, memory: dict[str, Any]) -> None:
    from rich.table import Table

    from scratchlm.cli.accounting import si
    from scratchlm.model.memory import HEADROOM

    budget = memory["budget"]
    where = (
        "per process"
        if budget is None or not budget["shared"]
        else f"per process; the {memory['world']} share the RAM"
    )
    table = Table(title=f"Training memory at {memory['world']} process(es), {memory['precision']} ({where})")
    columns = (
        "parallel",
        "act. ckpt",
        "parameters",
        "gradients",
        "optimizer",
        "buffers",
        "activations",
        "total",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:2] else "right")
    if budget is not None:
        table.add_column(f"fits {si(budget['bytes'], 'B')}?")
    for row in memory["estimates"]:
        sizes = (row[key] for key in ("parameters", "gradients", "optimizer_state", "buffers", "activations"))
        cells = [row["parallel"] or "-", "yes" if row["checkpointing"] else "no"]
        cells += [*(si(size, "B") for size in sizes), si(row["total"], "B")]
        table.add_row(*cells, *([] if budget is None else ["yes" if row["fits"] else "no"]))
    out.print(table)
    out.print(
        "buffers: FSDP's gathered weights and unsharded gradients (DDP's buckets are its gradients); "
        "activations: one micro-batch (an upper estimate, see docs/distributed.md)"
    )
    if budget is None:
        out.print("the device profile gives no memory size: nothing to compare the estimates with")
        return
    out.print(
        f"memory: {budget['what']}, {si(budget['bytes'], 'B')} (an estimate fits within {HEADROOM:.0%})"
    )
    chosen = memory["suggestion"]
    if chosen is None:
        out.print(
            f"suggestion: nothing fits, even at {memory['largest_world']} processes under fsdp with activation "
            "checkpointing: raise training.grad_accum (smaller micro-batches), or train a smaller model"
        )
    else:
        out.print(f"suggestion: {chosen['layout']} ({si(chosen['total'], 'B')} per process)")
