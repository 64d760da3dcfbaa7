"""What a kind of parallelism is given (`ParallelSettings`: plain values, never a training config) and what it
hands the training step (`Execution`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParallelSettings:
    """The plain values the kinds of parallelism read, each kind those it has a use for (as torchtitan's
    `apply_fsdp` takes them): the processes of the run, the dtype the blocks compute in (FSDP gathers them in
    it), whether to compile, and whether FSDP frees a block's gathered parameters after its forward."""

    world_size: int
    compute_dtype: torch.dtype = torch.float32
    compile: bool = False
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Execution:
    """How the model trains: `train_model` takes the training forward passes (under DDP, its wrapper),
    `forward_model` the evaluation's (compiled where asked). `no_sync`, where the kind has one, is the
    context in which a micro-batch's gradients stay on this process, to be added to the next one's (DDP
    averages them once a step, on the last micro-batch). `lockstep`: every forward pass is a collective
    operation (FSDP gathers parameters in it), so all processes must run as many."""

    forward_model: nn.Module
    train_model: nn.Module
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    lockstep: bool = False

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's forward and backward passes (`last`: the step's last one)."""
        if self.no_sync is not None and not last:
            return self.no_sync()
        return contextlib.nullcontext()
