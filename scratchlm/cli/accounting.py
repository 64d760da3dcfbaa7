"""`scratchlm accounting`: parameters, forward FLOPs, AdamW training memory and time of a model shape, as tables.

    scratchlm accounting --preset gpt2-xl
    scratchlm accounting --preset gpt2-xl --context-length 16384
    scratchlm accounting --compare                  # the four GPT-2 sizes side by side
    scratchlm accounting --d-model 512 --num-layers 4 --num-heads 16 --d-ff 1344 --vocab-size 10000 --context-length 256

Every number comes from `scratchlm.model.accounting`, where each formula is documented.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

HELP = "Count parameters, FLOPs per matmul, AdamW training memory and training time for a model shape."

SHAPE_FLAGS = ("vocab_size", "context_length", "num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.model.accounting import GPT2_PRESETS
    from scratchlm.model.config import FFNS, NORMS

    parser.add_argument(
        "--preset", choices=list(GPT2_PRESETS), help="a GPT-2 shape (default: the TinyStories model)"
    )
    shape = parser.add_argument_group("model shape (each overrides the preset)")
    for name in SHAPE_FLAGS:
        shape.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N")
    shape.add_argument("--ffn", choices=FFNS, help="feed-forward network (default swiglu)")
    shape.add_argument("--norm", choices=NORMS, help="RMSNorm placement (default pre)")
    shape.add_argument(
        "--tie-embeddings", action="store_true", help="the LM head reuses the token embeddings"
    )
    parser.add_argument(
        "--compare", action="store_true", help="the four GPT-2 presets side by side (at --context-length)"
    )
    budget = parser.add_argument_group("training budget")
    budget.add_argument("--batch-size", type=int, default=1, help="batch for the memory table (default 1)")
    budget.add_argument(
        "--memory-gb", type=float, default=80.0, help="accelerator memory, GB = 1e9 bytes (80)"
    )
    budget.add_argument("--train-batch", type=int, default=1024, help="batch size of the training run (1024)")
    budget.add_argument(
        "--steps", type=int, default=400_000, help="optimizer steps of the training run (400K)"
    )
    budget.add_argument(
        "--peak-tflops", type=float, default=19.5, help="accelerator peak, TFLOP/s (19.5: A100 float32)"
    )
    budget.add_argument("--mfu", type=float, default=0.5, help="model FLOPs utilisation (0.5)")


def run(args: argparse.Namespace) -> None:
    from rich.console import Console

    from scratchlm.errors import ScratchlmError
    from scratchlm.model import accounting as acc
    from scratchlm.model.config import ModelConfig

    for name in ("batch_size", "train_batch", "steps"):
        if getattr(args, name) <= 0:
            raise ScratchlmError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("memory_gb", "peak_tflops"):
        if not getattr(args, name) > 0:
            raise ScratchlmError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 < args.mfu <= 1:
        raise ScratchlmError(f"--mfu must be in (0, 1], got {args.mfu}")

    # Wide tables: a pipe or a file gets 140 columns rather than rich's default 80.
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    overrides = {
        name: getattr(args, name) for name in (*SHAPE_FLAGS, "ffn", "norm") if getattr(args, name) is not None
    }
    if args.tie_embeddings:
        overrides["tie_embeddings"] = True
    if args.compare:
        configs = {name: dataclasses.replace(c, **overrides) for name, c in acc.GPT2_PRESETS.items()}
        out.print(compare_table(configs))
        return
    base = acc.GPT2_PRESETS[args.preset] if args.preset else ModelConfig()
    if "ffn" in overrides and "d_ff" not in overrides and not args.preset:
        overrides["d_ff"] = None  # the new feed-forward's default width
    config = dataclasses.replace(base, **overrides)

    out.print(
        f"[bold]{args.preset or 'model'}[/]: vocab {config.vocab_size:,}, context {config.context_length:,}, "
        f"{config.num_layers} layers, d_model {config.d_model:,}, {config.num_heads} heads"
        f"{f' ({config.kv_heads} key/value heads)' if config.num_kv_heads else ''}, d_ff {config.d_ff:,}, "
        f"{config.ffn}, {config.norm}-norm{', tied embeddings' if config.tie_embeddings else ''}"
    )
    out.print(parameters_table(config))
    out.print(flops_table(config))
    out.print(memory_table(config, args.batch_size, args.memory_gb * 1e9))
    out.print(compute_table(config, args.train_batch, args.steps, args.peak_tflops * 1e12, args.mfu))


def si(value: float, unit: str) -> str:
    """`4.51e12, 'FLOP'` -> `4.51 TFLOP` (decimal prefixes, as FLOP/s and GB are quoted)."""
    for factor, prefix in (
        (1e21, "Z"),
        (1e18, "E"),
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
    ):
        if abs(value) >= factor:
            return f"{value / factor:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def parameters_table(config):
    from rich.table import Table

    from scratchlm.model import accounting as acc

    counts = acc.parameter_counts(config)
    total = sum(counts.values())
    table = Table(title="Trainable parameters (float32: 4 bytes each)", title_justify="left")
    for column in ("component", "parameters", "share", "float32 memory"):
        table.add_column(column, justify="left" if column == "component" else "right")
    for name, count in counts.items():
        table.add_row(name, f"{count:,}", f"{count / total:.1%}", si(4 * count, "B"))
    table.add_section()
    table.add_row("[bold]total", f"[bold]{total:,}", "100%", f"[bold]{si(4 * total, 'B')}")
    return table


def flops_table(config):
    from rich.table import Table

    from scratchlm.model import accounting as acc

    matmuls = acc.forward_matmuls(config)
    total = sum(m.flops for m in matmuls)
    table = Table(
        title=f"Matmuls of one forward pass over one sequence of {config.context_length:,} tokens "
        "((m×n)(n×p) costs 2mnp FLOPs)",
        title_justify="left",
    )
    for column in ("component", "matmul", "(m × n)(n × p)", "times", "FLOPs", "share"):
        table.add_column(
            column, justify="left" if column in ("component", "matmul") else "right", no_wrap=True
        )
    for component in acc.COMPONENTS:
        group = [m for m in matmuls if m.component == component]
        for i, m in enumerate(group):
            label = component if i == 0 else ""
            shape = f"({m.m:,}×{m.n:,})({m.n:,}×{m.p:,})"
            table.add_row(label, m.name, shape, f"{m.count:,}", si(m.flops, "FLOP"), f"{m.flops / total:.1%}")
        subtotal = sum(m.flops for m in group)
        table.add_row(
            "",
            "[bold]total",
            "",
            "",
            f"[bold]{si(subtotal, 'FLOP')}",
            f"[bold]{subtotal / total:.1%}",
        )
        table.add_section()
    table.add_row("[bold]forward total", "", "", "", f"[bold]{si(total, 'FLOP')}", "100%")
    return table


def memory_table(config, batch_size: int, memory_bytes: float):
    from rich.table import Table

    from scratchlm.model import accounting as acc

    memory = acc.training_memory(config)
    activations = acc.activation_elements(config, batch_size)
    table = Table(
        title=f"AdamW training memory, float32, batch {batch_size:,} × {config.context_length:,} tokens",
        title_justify="left",
    )
    for column in ("part", "formula", f"batch {batch_size:,}"):
        table.add_column(column, justify="left" if column != f"batch {batch_size:,}" else "right")
    table.add_row("parameters", "4 bytes × P", si(memory.parameters, "B"))
    table.add_row("gradients", "4 bytes × P", si(memory.gradients, "B"))
    table.add_row("optimizer state (m, v)", "8 bytes × P", si(memory.optimizer_state, "B"))
    table.add_row(
        "activations",
        f"{si(memory.activations_per_sequence, 'B')} × batch",
        si(memory.activations_per_sequence * batch_size, "B"),
    )
    for name, elements in activations.items():
        table.add_row(f"  [dim]{name}", "", f"[dim]{si(4 * elements, 'B')}")
    table.add_section()
    table.add_row(
        "[bold]peak total",
        f"{si(memory.fixed, 'B')} + {si(memory.activations_per_sequence, 'B')} × batch",
        f"[bold]{si(memory.total(batch_size), 'B')}",
    )
    largest = memory.max_batch_size(memory_bytes)
    table.caption = f"largest batch that fits in {si(memory_bytes, 'B')}: [bold]{largest:,}[/]"
    table.caption_justify = "left"
    return table


def compute_table(config, batch_size: int, steps: int, peak_flops: float, mfu: float):
    from rich.table import Table

    from scratchlm.model import accounting as acc

    forward = acc.forward_flops(config, batch_size=batch_size)
    step = acc.train_step_flops(config, batch_size)
    total = step * steps
    days = acc.training_days(total, peak_flops, mfu)
    table = Table(
        title=f"Training: {steps:,} AdamW steps of {batch_size:,} × {config.context_length:,} tokens",
        title_justify="left",
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("forward pass", si(forward, "FLOP"))
    table.add_row("backward pass (2 × forward)", si(2 * forward, "FLOP"))
    table.add_row("[bold]one AdamW step (3 × forward)", f"[bold]{si(step, 'FLOP')}")
    table.add_row(f"{steps:,} steps", si(total, "FLOP"))
    table.add_row(
        f"[bold]time at {mfu:.0%} MFU of {si(peak_flops, 'FLOP/s')}",
        f"[bold]{days:,.1f} days" + (f" ({days / 365.25:,.1f} years)" if days >= 365.25 else ""),
    )
    return table


def compare_table(configs):
    from rich.table import Table

    from scratchlm.model import accounting as acc

    context = next(iter(configs.values())).context_length
    table = Table(
        title=f"Forward FLOPs per sequence of {context:,} tokens, by component", title_justify="left"
    )
    table.add_column("model")
    table.add_column("parameters", justify="right")
    for component in acc.COMPONENTS:
        table.add_column(component, justify="right")
    table.add_column("forward total", justify="right")
    for name, config in configs.items():
        flops = acc.flops_by_component(config)
        total = sum(flops.values())
        shares = [f"{flops[c] / total:.1%}" for c in acc.COMPONENTS]
        table.add_row(name, si(acc.num_parameters(config), ""), *shares, si(total, "FLOP"))
    return table
