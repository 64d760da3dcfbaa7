"""How big the quickstart is, and the training configuration that makes of it.

Two sizes of every stage: `FULL` (the default: the whole standard library, a 4,096-token vocabulary, a
model trained for the time budget) and `SMALL` (`--small`: seconds a stage, for tests and a first look).
The fast recipe picks its shape for the budget from a ladder, `FAST_SHAPES` (`scratchlm.training.sizing`);
`RECIPES` are the training recipes of `--recipe` in the quickstart's shape. `train_config` puts a size, a
recipe and a shape together into the `TrainConfig` the training stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.data.prepare import PreparedData
from scratchlm.errors import ScratchlmError
from scratchlm.training.budget import CALIBRATION_STEPS
from scratchlm.training.config import TrainConfig
from scratchlm.training.recipes import RECIPES as TRAINING_RECIPES
from scratchlm.training.recipes import merged
from scratchlm.training.sizing import Shape


@dataclass(frozen=True)
class QuickstartSize:
    """How big each stage is."""

    corpus_bytes: int | None  # cap on the training text; None: the whole standard library (~10 MB)
    vocab_size: int
    model: dict[str, Any]  # ModelConfig fields
    batch_size: int
    lr: float
    warmup_iters: int
    max_steps: int | None  # the schedule's length; None: as many steps as fit in the time budget
    eval_interval: int
    sample_tokens: int
    compile: bool  # torch.compile on a CPU too (always on a GPU)


FULL = QuickstartSize(
    corpus_bytes=None,
    vocab_size=4096,
    model={"context_length": 256, "d_model": 256, "num_layers": 4, "num_heads": 8, "rope_theta": 10_000.0},
    batch_size=16,
    lr=2e-3,
    warmup_iters=30,
    max_steps=None,
    eval_interval=50,
    sample_tokens=200,
    # Measured on two cores in bf16: 276 ms per compiled step against 382 ms eager, for about 10 s of
    # compilation.
    compile=True,
)
# Seconds per stage: for tests and a first look at the output.
SMALL = QuickstartSize(
    corpus_bytes=300_000,
    vocab_size=512,
    model={"context_length": 64, "d_model": 64, "num_layers": 2, "num_heads": 4, "rope_theta": 10_000.0},
    batch_size=16,
    lr=3e-3,
    warmup_iters=10,
    max_steps=100,
    eval_interval=50,
    sample_tokens=40,
    compile=False,  # compiling would take longer than this whole run
)

#: The fast recipe's shapes for a budget (`scratchlm.training.sizing`), smallest first, each with the steps of
#: its own it needs in the budget to beat the one before it (measured: docs/experiments.md, "The shape for
#: the budget"). The smallest fits minutes on a CPU: 2 layers rather than the CS336 assignment-1 handout's 4 (so one
#: value-embedding table) and 8 sequences a step rather than 16, about three times the steps. Given the steps,
#: 16 sequences a step learn more from the same time: with the batch twice as large a step takes less than
#: twice as long, and its gradient is less noisy. 4 layers at 16 sequences measured worse than both at every
#: budget tried, so they are not on the ladder.
FAST_SHAPES: tuple[Shape, ...] = (
    Shape(
        "2 layers, 8 sequences a step",
        {"model": {"num_layers": 2, "value_embeddings": 1}, "training": {"batch_size": 8}},
    ),
    Shape(
        "2 layers, 16 sequences a step",
        {"model": {"num_layers": 2, "value_embeddings": 1}, "training": {"batch_size": 16}},
        min_steps=300,
    ),
)
#: The training recipes of `--recipe`, as changes to `train_config`'s sections: those of
#: `scratchlm.training.recipes`, each in the quickstart's shape. "fast" is in the smallest of `FAST_SHAPES`
#: here (where no budget chooses: a run of a fixed step count, a variant of a benchmark); its warm-up is the
#: steps that measure the speed.
QUICKSTART_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "fast": merged(FAST_SHAPES[0].changes, {"schedule": {"warmup_iters": CALIBRATION_STEPS}}),
}
RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    name: merged(recipe, QUICKSTART_SHAPES.get(name, {})) for name, recipe in TRAINING_RECIPES.items()
}
DEFAULT_RECIPE = "fast"


def train_config(
    size: QuickstartSize,
    data: PreparedData,
    run_dir: Path,
    seconds: float,
    device: str,
    max_steps: int,
    recipe: str = "spec",
    shape: Shape | None = None,
) -> TrainConfig:
    """The training configuration of the quickstart's model, trained with `recipe` (a key of `RECIPES`), in
    `shape` when given (one of `FAST_SHAPES`, for the fast recipe) rather than the recipe's own."""
    if recipe not in RECIPES:
        raise ScratchlmError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    values: dict[str, dict[str, Any]] = {
        "data": {"train": str(data.train), "valid": str(data.valid), "tokenizer": str(data.tokenizer)},
        "model": {"vocab_size": size.vocab_size, **size.model},
        "optimizer": {"lr": size.lr, "min_lr": size.lr / 10, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"warmup_iters": size.warmup_iters},
        "training": {
            "batch_size": size.batch_size,
            "max_steps": max_steps,
            "max_time_s": seconds,
            "device": device,
            "precision": "auto",
            "compile": size.compile or device.startswith("cuda"),
            "seed": 0,
        },
        "eval": {"interval": size.eval_interval, "iters": 5},
        "checkpoint": {"interval": 100},
        "logging": {"run_dir": str(run_dir), "log_interval": 5},
    }
    for section, changes in merged(RECIPES[recipe], shape.changes if shape else {}).items():
        values[section] = values[section] | changes
    return TrainConfig.from_dict(values)
