"""A stage: where a training run's batches and its loss come from. The loop knows nothing else of them.

The training loop is the same for every stage (time budget, checkpoints, exact resume, metrics); what differs
is what a row of a batch is and what the loss of a row is:

    stage           config section   a row                            its loss
    pretraining     [data]           a window of tokens               cross-entropy of every next token
    fine-tuning     [sft]            a conversation                   cross-entropy of the assistant's tokens
    reinforcement   [rl]             a sampled reply to a prompt      the clipped policy-gradient objective

A stage is a `Stage` in `STAGES`, registered beside its code (`register_stage`), with its config section (a
dataclass with a `check(source)` method) and `load(config, run_dir)`, which reads its data and returns a
`TrainingData` whose batches are `Examples`. A config holds exactly one stage's section; one without any is
pretraining's. The step (`scratchlm.training.step`) draws a batch (`Examples.draw`), slices it by row among
the processes and micro-batches, weighs each slice by its share of the batch's counted targets
(`Examples.counted`), and calls `Examples.loss` on it: the mean loss over its counted targets.

`Examples` is a protocol, so that the classes that implement it (`scratchlm.data.tokens.TokenWindows`, the
chat package's `ConversationBatches`) need not import the training package: evaluation reads token windows
too, and inference imports nothing from training. Nothing here imports a stage built on the loop (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.directory import RunDirectory
from scratchlm.tokenizer.tokenizer import Tokenizer


class Examples(Protocol):
    """A stage's training or validation examples, drawn a batch of rows at a time."""

    tokens_per_row: float  # the inputs a row holds (on average): what tokens/s counts
    passes: int  # optimizer steps a drawn batch takes (1; reinforcement learning's epochs_per_batch)

    def draw(self, batch_size: int, generator: np.random.Generator, policy: TransformerLM) -> Any:
        """The rows of one step, drawn with `generator` (whose state the checkpoints keep), indexable by a
        slice of rows (a process's share, a micro-batch). `policy` is the model as it is now, for a stage
        whose rows it writes (sampled replies); the other stages ignore it."""
        ...

    def counted(self, rows: Any) -> int:
        """How many targets the loss counts in `rows`."""
        ...

    def loss(self, rows: Any, model: Callable[..., Tensor], device: torch.device, fused: bool) -> Tensor:
        """The mean loss over the counted targets of `rows` under `model` (the training forward), as a
        scalar tensor that backpropagates; `fused`: the model may compute the LM head and the loss together
        (`TransformerLM.forward(inputs, targets=...)`), where every target counts."""
        ...

    def validation_batches(self, iters: int, batch_size: int, seed: int) -> list[Any]:
        """The rows of the validation estimate, `iters` batches of `batch_size`: the same ones every time."""
        ...


@dataclass(frozen=True)
class TrainingData:
    """What a run reads: its training and validation examples and its tokenizer (None when the config names
    none), checked against the model and the copy in the run directory, which a resumed run must not change."""

    train: Examples
    valid: Examples
    tokenizer: Tokenizer | None


@dataclass(frozen=True)
class Stage:
    """A registered stage: its config section's name and dataclass, how it loads its data, and whether its
    model may grow its vocabulary from `training.init_from`'s (fine-tuning adds the chat template's tokens,
    whose rows start as the mean of the others).

    Two hooks let a stage measure what a loss does not say: `evaluate(valid, model)`, the `EvalRecord` fields
    of a validation (None: the loss of the validation batches, `val_loss`), and `train_metrics(train)`, the
    `TrainRecord` fields of the steps since the last log record (None: none)."""

    section: str
    config: type
    load: Callable[[Any, RunDirectory], TrainingData]
    grows_vocabulary: bool = False
    evaluate: Callable[[Any, Any], dict[str, float]] | None = None
    train_metrics: Callable[[Any], dict[str, float]] | None = None


STAGES: dict[str, Stage] = {}
# Pretraining's section, the stage of a config that names none. Its stage (scratchlm.training.inputs) is
# registered by the training package's `__init__`, so that every config knows it, while the config module
# names it here and never imports it (the inputs read token files, which a config does not need).
PRETRAINING = "data"


def register_stage(stage: Stage) -> Stage:
    """Make `stage`'s section a config section (called where the stage is defined)."""
    STAGES[stage.section] = stage
    return stage


def load_training_data(config: Any, run_dir: RunDirectory) -> TrainingData:
    """What the run of `config` (a `TrainConfig`) reads, loaded by its stage."""
    return STAGES[config.stage_name].load(config, run_dir)


def check_run_tokenizer(tokenizer: Tokenizer, name: str, run_dir: RunDirectory) -> None:
    """A resumed run must not change its tokenizer (`name` says where this one came from)."""
    copy = run_dir.tokenizer_dir
    if copy.is_dir() and Tokenizer.from_dir(copy).fingerprint != tokenizer.fingerprint:
        raise ScratchlmError(
            f"{name} is not the tokenizer this run was trained with ({copy}); use another logging.run_dir"
        )
