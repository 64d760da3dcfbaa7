"""Memory and speed per process of multi-process training, DDP against FSDP, at several world sizes (CPU, Gloo).

For every `--parallel` and `--world` it launches `torchrun --standalone --nproc-per-node N` on this file, whose
processes build the training run exactly as `scratchlm train` does (`trainer.build_session`, on random tokens),
take `--warmup` steps and then `--steps` timed ones, and report per process:

- the state bytes: parameters + gradients + optimizer state, summed over the tensors themselves (for a
  sharded parameter, a DTensor, its local shard: `to_local()`); the gradients are counted after the backward
  pass of the last step, before the update frees them;
- the peak resident memory (`VmHWM` of /proc/self/status), and its rise over the resident memory before the
  data and the model were loaded (torch's own libraries take the rest; the device measurement of a first run
  on a machine may set the peak);
- tokens/s over the timed steps, and where a step's time goes: forward + backward + gradient exchange
  (`TrainStep.gradients`), against the optimizer's update (`TrainStep.update`).

Then it prints, per world size, FSDP's state bytes over DDP's (the target: at most 1.1 / N) and its tokens/s over
DDP's, and the largest model whose training state (parameters, gradients, optimizer:
`scratchlm.model.memory`) the estimate fits in a 24 GB and an 80 GB GPU under each layout, before activations.

FSDP is selected by the config key `training.parallel = "fsdp"`; a scratchlm whose config does not know that key
skips it with one line.

    python benchmarks/bench_distributed.py --parallel ddp fsdp --world 1 2 4
    python benchmarks/bench_distributed.py --parallel ddp --world 1 2 --d-model 64 --layers 2 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write
from scratchlm.model.accounting import num_parameters
from scratchlm.model.memory import HEADROOM, rank_memory
from scratchlm.training.config import TrainConfig

GPUS = {"24 GB": 24e9, "80 GB": 80e9}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    parser.add_argument("--world", nargs="+", type=int, default=[1, 2, 4], help="processes (default 1 2 4)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    parser.add_argument("--optimizer", choices=("adamw", "muon", "sgd"), default="adamw")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument(
        "--worker", metavar="DIR", help=argparse.SUPPRESS
    )  # a torchrun process: its directory
    return parser.parse_args(argv)


def config_values(args: argparse.Namespace, directory: Path, parallel: str) -> dict:
    training = {"batch_size": args.batch, "max_steps": args.warmup + args.steps, "device": "cpu"}
    training |= {"precision": args.precision, "threads": 1, "compile": False}
    if parallel != "ddp":  # the default; the key is given only where it selects something else
        training["parallel"] = parallel
    return {
        "data": {"train": str(directory / "tokens.npy"), "valid": str(directory / "tokens.npy")},
        "model": {
            "vocab_size": args.vocab, "context_length": args.context, "d_model": args.d_model,
            "num_layers": args.layers, "num_heads": args.heads,
        },
        "optimizer": {"name": args.optimizer},
        "training": training,
        "eval": {"interval": 0},
        "checkpoint": {"interval": 0},
        "logging": {"run_dir": str(directory / "run")},
    }  # fmt: skip


# -- one process of a torchrun job ---------------------------------------------------------------------------


def local_bytes(tensors) -> int:
    """Bytes of `tensors` held by this process: a DTensor's local shard, a tensor's whole storage."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def resident_kib(field: str) -> int:
    """A `Vm*` line of /proc/self/status, in KiB (VmRSS: now; VmHWM: the peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from scratchlm.device import plan
    from scratchlm.run.directory import RunDirectory
    from scratchlm.training.distributed import init_distributed, shutdown_distributed
    from scratchlm.training.stage import load_training_data
    from scratchlm.training.trainer import Session, build_session

    directory = Path(args.worker)
    config = TrainConfig.from_dict(json.loads((directory / "config.json").read_text()))
    info, device = init_distributed(torch.device("cpu"))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as training does on a CPU
    t = config.training
    choices = plan(device, t.precision, t.compile, t.threads, t.fused_loss)  # may measure the device first
    before = resident_kib("VmRSS")
    run_dir = RunDirectory(config.logging.run_dir)
    session = Session(config, run_dir, load_training_data(config, run_dir), info, device, choices)
    run = build_session(session, resume=False)
    stepper, model = run.stepper, run.model
    times = {"gradients": 0.0, "update": 0.0}
    grads = 0
    for step in range(1, args.warmup + args.steps + 1):
        timed = step > args.warmup
        if info.enabled:
            dist.barrier()
        start = time.perf_counter()
        _, _, applied = stepper.gradients(step, run.budget, run.data.train, run.generator, run_dir)
        middle = time.perf_counter()
        grads = local_bytes(p.grad for p in model.parameters())
        stepper.update(applied)
        if info.enabled:
            dist.barrier()
        if timed:
            times["gradients"] += middle - start
            times["update"] += time.perf_counter() - middle
    optimizer_state = [value for state in stepper.optimizer.state.values() for value in state.values()]
    report = {
        "rank": info.rank,
        "parameters": local_bytes(model.parameters()),
        "gradients": grads,
        "optimizer": local_bytes(optimizer_state),
        "peak_kib": resident_kib("VmHWM"),
        "rise_kib": resident_kib("VmHWM") - before,
        "seconds": times,
        "tokens": args.steps * t.batch_size * config.model.context_length,
    }
    reports = [report]
    if info.enabled:
        reports = [None] * info.world_size
        dist.all_gather_object(reports, report)
    if info.is_main:
        with atomic_write(directory / "report.json", "w") as f:
            json.dump(reports, f)
    shutdown_distributed(finished=True)


# -- the driver ----------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, root: Path, parallel: str, world: int) -> list[dict]:
    directory = root / f"{parallel}-{world}"
    directory.mkdir()
    (directory / "tokens.npy").symlink_to(root / "tokens.npy")
    (directory / "config.json").write_text(json.dumps(config_values(args, directory, parallel)))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        __file__, *sys.argv[1:], "--worker", str(directory),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{parallel} at {world} processes failed:\n{result.stderr[-3000:]}")
    return json.loads((directory / "report.json").read_text())


def supported(args: argparse.Namespace, parallel: str) -> str | None:
    """None if this scratchlm's config accepts `parallel`, else why not."""
    try:
        TrainConfig.from_dict(config_values(args, Path("."), parallel))
    except ScratchlmError as e:
        return str(e)
    return None


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def main() -> None:
    args = arguments()
    if args.worker:
        return worker(args)
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        root = Path(tmp)
        tokens = np.random.default_rng(0).integers(0, args.vocab, 200_000).astype(np.uint16)
        np.save(root / "tokens.npy", tokens)
        for parallel in args.parallel:
            if (why := supported(args, parallel)) is not None:
                print(f"{parallel}: skipped, this scratchlm's config refuses it ({why})")
                continue
            for world in args.world:
                if args.batch % world:
                    print(f"{parallel} at {world}: skipped, the batch of {args.batch} does not divide")
                    continue
                reports = launch(args, root, parallel, world)
                state = max(r["parameters"] + r["gradients"] + r["optimizer"] for r in reports)
                slowest = max(sum(r["seconds"].values()) for r in reports)
                results[parallel, world] = {
                    "state": state,
                    "parts": max(reports, key=lambda r: r["parameters"] + r["gradients"] + r["optimizer"]),
                    "peak": max(r["peak_kib"] for r in reports) * 1024,
                    "rise": max(r["rise_kib"] for r in reports) * 1024,
                    "tokens_s": reports[0]["tokens"] / slowest,
                    "split": {
                        k: max(r["seconds"][k] for r in reports) / args.steps for k in ("gradients", "update")
                    },
                }
                print(f"{parallel} at {world}: done", file=sys.stderr, flush=True)
    model = TrainConfig.from_dict(config_values(args, Path("."), "ddp")).model
    print(
        f"model: d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}, context {args.context}, "
        f"{num_parameters(model):,} parameters; {args.optimizer}, {args.precision}, global batch {args.batch}, "
        f"{args.steps} timed steps; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    header = f"{'layout':<12}{'params':>12}{'grads':>12}{'optimizer':>12}{'state':>12}{'peak RSS':>12}"
    print(header + f"{'rise':>12}{'tokens/s':>10}{'fwd+bwd ms':>12}{'update ms':>11}")
    for (parallel, world), r in results.items():
        p = r["parts"]
        sizes = (p["parameters"], p["gradients"], p["optimizer"], r["state"], r["peak"], r["rise"])
        print(
            f"{parallel + ' ' + str(world):<12}" + "".join(f"{megabytes(n):>12}" for n in sizes)
            + f"{r['tokens_s']:>10,.0f}{1e3 * r['split']['gradients']:>12,.1f}{1e3 * r['split']['update']:>11,.1f}"
        )  # fmt: skip
    for world in args.world:
        if ("ddp", world) in results and ("fsdp", world) in results:
            ddp, fsdp = results["ddp", world], results["fsdp", world]
            ratio = fsdp["state"] / ddp["state"]
            verdict = "meets" if ratio <= 1.1 / world else "misses"
            print(
                f"{world} processes: FSDP/DDP state bytes {ratio:.3f} ({verdict} the target ≤ 1.1/{world} = "
                f"{1.1 / world:.3f}); tokens/s {fsdp['tokens_s'] / ddp['tokens_s']:.2f}"
            )
    print(
        f"largest model whose training state the estimate fits ({HEADROOM:.0%} of the memory, before activations):"
    )
    parameters = num_parameters(model)
    for parallel, world in results:
        estimate = rank_memory(model, args.optimizer, args.precision, args.batch, 1, world, parallel, False)
        per_parameter = estimate.state / parameters  # DDP's buckets are its gradients: nothing more
        fits = ", ".join(
            f"{name}: {HEADROOM * size / per_parameter / 1e9:.2f} B" for name, size in GPUS.items()
        )
        print(f"  {parallel} {world}: {per_parameter:.1f} bytes a parameter; {fits}")


if __name__ == "__main__":
    main()
