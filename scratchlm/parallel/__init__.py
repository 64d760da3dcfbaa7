"""How a model is spread over processes to train: applied to an unchanged `TransformerLM`, one
function a kind, each in a file of its own.

    parallelize            the one entry the trainer calls: activation checkpointing, then the kind of
                           parallelism named (`PARALLELISMS`), which compiles the model as it needs; in a
                           single process, compilation alone
    ddp.py                 DistributedDataParallel: a whole copy on every process, gradients all-reduced
    fsdp.py                FSDP2: parameters, gradients and optimizer state sharded across processes
    checkpointing.py       activation checkpointing: each block recomputed in the backward pass
    execution.py           `Execution`, what a kind hands the training step

This package sits above the model (which knows nothing of processes) and the device (which knows the machine
but never touches a model). The optimizers meet sharded parameters as DTensors and step on each process's
shard (`scratchlm.training.optim`, `scratchlm.training.muon`, `scratchlm.training.grad`). Nothing here reads
a training config: the trainer hands over plain values, as torchtitan's `apply_fsdp` takes them. A new kind is
its function, `(model, device, settings: ParallelSettings) -> Execution` (the settings are plain values; a kind
reads those it has a use for), its line in `PARALLELISMS`, and its name in `ParallelName` (scratchlm/parallelisms.py, which `training.parallel` accepts; a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.checkpointing import apply_activation_checkpointing
from scratchlm.parallel.ddp import parallelize_ddp
from scratchlm.parallel.execution import Execution, ParallelSettings
from scratchlm.parallel.fsdp import parallelize_fsdp
from scratchlm.parallelisms import ParallelName

#: A name of `ParallelName` -> the function that applies it in a run of several processes.
PARALLELISMS: dict[str, Callable[[TransformerLM, torch.device, ParallelSettings], Execution]] = {
    "ddp": parallelize_ddp,
    "fsdp": parallelize_fsdp,
}

__all__ = ["PARALLELISMS", "Execution", "ParallelSettings", "parallelize"]


def parallelize(
    model: TransformerLM,
    parallel: ParallelName,
    device: torch.device,
    settings: ParallelSettings,
    activation_checkpointing: bool = False,
) -> Execution:
    """`model` made ready to train: its blocks checkpointed (`activation_checkpointing`), compiled
    (`settings.compile`) and, over `settings.world_size` > 1 processes, spread over them as `parallel` says (in
    one process `parallel` is ignored). Under FSDP the parameters become shards: make the optimizer after this."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if settings.world_size > 1:
        return PARALLELISMS[parallel](model, device, settings)
    forward_model = torch.compile(model) if settings.compile else model
    return Execution(forward_model, forward_model)
