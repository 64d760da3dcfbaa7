"""How a model is spread over processes and laid out to run: applied to an unchanged `TransformerLM`, one
function a kind, each in a file of its own.

    parallelize            the one entry the trainer calls: activation checkpointing, then the kind of
                           parallelism `training.parallel` names (`PARALLELISMS`), which compiles the model as
                           it needs; in a single process, compilation alone
    ddp.py                 DistributedDataParallel: a whole copy on every process, gradients all-reduced
    fsdp.py                FSDP2: parameters, gradients and optimizer state sharded across processes
    checkpointing.py       activation checkpointing: each block recomputed in the backward pass
    execution.py           `Execution`, what a kind hands the training step
    inference.py           the device plan's layout of a model for inference (`Plan.for_inference`)

This package sits above the model (which knows nothing of processes) and the device (which knows the machine
but never touches a model). The optimizers meet sharded parameters as DTensors and step on each process's
shard (`scratchlm.training.optim`, `scratchlm.training.muon`, `scratchlm.training.grad`). A new kind is its
function, `(model, training, plan, device, dist) -> Execution`, and its line in `PARALLELISMS`;
`training.parallel` accepts every key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

from scratchlm.console import console
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.checkpointing import apply_activation_checkpointing
from scratchlm.parallel.ddp import parallelize_ddp
from scratchlm.parallel.execution import Execution
from scratchlm.parallel.fsdp import parallelize_fsdp

if TYPE_CHECKING:  # not imported when running: inference reaches this package, and never training
    from scratchlm.device import Plan
    from scratchlm.training.config import TrainingConfig
    from scratchlm.training.distributed import Distributed

#: `training.parallel` -> the function that applies it in a run of several processes.
PARALLELISMS: dict[str, Callable[..., Execution]] = {"ddp": parallelize_ddp, "fsdp": parallelize_fsdp}
ParallelName = Literal[tuple(PARALLELISMS)]  # the config accepts exactly the registered names

__all__ = ["PARALLELISMS", "Execution", "ParallelName", "parallelize"]


def parallelize(
    model: TransformerLM, training: TrainingConfig, plan: Plan, device: torch.device, dist: Distributed
) -> Execution:
    """`model` made ready to train as `training` and `plan` say: its blocks checkpointed
    (`training.activation_checkpointing`), compiled (`plan.compile`) and, in a run of several processes,
    spread over them (`training.parallel`). Under FSDP the parameters become shards: make the optimizer
    after this."""
    if training.activation_checkpointing:
        apply_activation_checkpointing(model)
    if dist.enabled:
        return PARALLELISMS[training.parallel](model, training, plan, device, dist)
    if training.parallel != "ddp" and dist.is_main:
        console.print(f'training.parallel = "{training.parallel}" in one process: ignored')
    forward_model = torch.compile(model) if plan.compile.value else model
    return Execution(forward_model, forward_model)
