"""`scratchlm doctor [--config FILE] [--set KEY=VALUE ...] [--json]`: the device, what it can do, and what
scratchlm will do on it.

It prints the device (the CPU's model and the flags that matter, or the GPU's name, memory and compute
capability), the cores this process may use and how many other processes keep busy, the measured matmul
rates (fp32 and bf16, and fp16 on a GPU) and memory bandwidth, when and how they were measured (`--refresh`
measures them again), whether torch.compile works here, and the precision, thread and compile choices
`scratchlm train` makes with that config, each with its reason (`scratchlm.device.choices`). `--json` prints
the same as one JSON object, for scripts. What takes seconds (measuring the device, compiling a test
function) is announced on stderr before it starts.
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_config_arguments

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


def run(args: argparse.Namespace) -> None:
    import json

    from scratchlm.training.config import TrainConfig, training_section

    # A mistake in the config is reported before torch loads.
    config = TrainConfig.load(args.config, args.overrides) if args.config else None
    t = config.training if config is not None else training_section(args.overrides)

    from rich.console import Console
    from rich.table import Table

    from scratchlm.console import console
    from scratchlm.device import plan, resolve_device
    from scratchlm.device.profile import (
        affinity_cpus,
        busy_cores,
        cgroup_cpu_limit,
        compile_works,
        measurement_note,
        usable_cores,
    )

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
    }
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
    peak = choices.peak_flops.value
    table.add_row(
        "MFU peak", f"{'' if peak is None else f'{peak / 1e12:,.1f} TFLOP/s '}({choices.peak_flops.reason})"
    )
    Console(highlight=False, soft_wrap=True, markup=False).print(table)  # the report, on stdout
    for warning in choices.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)
