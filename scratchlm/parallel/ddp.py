"""Data parallelism with DistributedDataParallel: every process holds the whole model, its gradients and its
optimizer state, trains on its own slice of the global batch, and the gradients are averaged across processes
during the backward pass (NCCL between GPUs, Gloo between CPU processes), so every copy takes the same step.

It costs the most memory of the kinds (16 bytes a parameter with float32 weights and AdamW, on every process)
and the least communication: one all-reduce of the gradients a step, overlapped with the backward pass. The
model is compiled whole, and wrapped compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.execution import Execution

if TYPE_CHECKING:
    from scratchlm.device import Plan
    from scratchlm.training.config import TrainingConfig
    from scratchlm.training.distributed import Distributed


def parallelize_ddp(
    model: TransformerLM, training: TrainingConfig, plan: Plan, device: torch.device, dist: Distributed
) -> Execution:
    """`model` (compiled where `plan` says) wrapped for data-parallel training in a multi-process run."""
    forward_model = torch.compile(model) if plan.compile.value else model
    device_ids = [device.index] if device.type == "cuda" else None
    train_model = DistributedDataParallel(forward_model, device_ids=device_ids)
    return Execution(forward_model, train_model, no_sync=train_model.no_sync)
