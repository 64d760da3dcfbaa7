"""How a model is spread over processes and laid out to run: applied to an unchanged `TransformerLM`, one
function a kind, each in a file of its own.

    parallelize            the one entry the trainer calls: activation checkpointing, compilation and the
                           parallelism of `[training]`, in the order they must be applied
    ddp.py                 DistributedDataParallel: a whole copy on every process, gradients all-reduced
    fsdp.py                FSDP2: parameters, gradients and optimizer state sharded across processes
    checkpointing.py       activation checkpointing: each block recomputed in the backward pass
    full_state.py          a sharded model's whole state in one process, for the single-file checkpoint
    inference.py           the device plan's layout of a model for inference (`Plan.for_inference`)

This package sits above the model (which knows nothing of processes) and the device (which knows the machine
but never touches a model). The optimizers meet sharded parameters as DTensors and step on each process's
shard (`scratchlm.training.optim`, `scratchlm.training.muon`, `scratchlm.training.grad`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from scratchlm.console import console
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.checkpointing import apply_activation_checkpointing
from scratchlm.parallel.ddp import parallelize_ddp
from scratchlm.parallel.fsdp import parallelize_fsdp

if TYPE_CHECKING:  # not imported when running: inference reaches this package, and never training
    from scratchlm.device import Plan
    from scratchlm.training.config import TrainingConfig
    from scratchlm.training.distributed import Distributed

Kind = Literal["single", "ddp", "fsdp"]


@dataclass(frozen=True)
class Execution:
    """How the model trains: `train_model` takes the training forward passes (under DDP, its wrapper),
    `forward_model` the evaluation's (compiled where asked), and `kind` says which parallelism runs them."""

    forward_model: nn.Module
    train_model: nn.Module
    kind: Kind = "single"

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's forward and backward passes (`last`: the step's last one). Under DDP
        the gradients are averaged once a step, on the last micro-batch; the others add to them locally.
        FSDP reduce-scatters every micro-batch's, in float32 into the float32 shards: skipping it would add
        them up whole, in the compute dtype, on every process."""
        if self.kind == "ddp" and not last:
            return self.train_model.no_sync()
        return contextlib.nullcontext()


def parallelize(
    model: TransformerLM, training: TrainingConfig, plan: Plan, device: torch.device, dist: Distributed
) -> Execution:
    """`model` made ready to train as `training` and `plan` say: its blocks checkpointed
    (`training.activation_checkpointing`), compiled (`plan.compile`) and, in a run of several processes,
    parallel (`training.parallel`). Under FSDP the parameters become shards: make the optimizer after this."""
    if training.activation_checkpointing:
        apply_activation_checkpointing(model)
    compiled = plan.compile.value
    if not dist.enabled:
        if training.parallel != "ddp" and dist.is_main:
            console.print(f'training.parallel = "{training.parallel}" in one process: ignored')
        forward_model = torch.compile(model) if compiled else model
        return Execution(forward_model, forward_model)
    if training.parallel == "fsdp":
        if compiled:  # block by block, before sharding: each compiled block is one unit of sharding
            for block in model.layers:
                block.compile()
        parallelize_fsdp(model, device, dist.world_size, plan.dtype, training.reshard_after_forward)
        return Execution(model, model, "fsdp")
    forward_model = torch.compile(model) if compiled else model
    return Execution(forward_model, parallelize_ddp(forward_model, device), "ddp")
