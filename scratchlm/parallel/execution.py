"""`Execution`: what a kind of parallelism hands the training step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


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
