"""Data parallelism with DistributedDataParallel: every process holds the whole model, its gradients and its
optimizer state, trains on its own slice of the global batch, and the gradients are averaged across processes
during the backward pass (NCCL between GPUs, Gloo between CPU processes), so every copy takes the same step.

It costs the most memory of the kinds (16 bytes a parameter with float32 weights and AdamW, on every process)
and the least communication: one all-reduce of the gradients a step, overlapped with the backward pass.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def parallelize_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` (compiled or not) wrapped for data-parallel training; call only in a multi-process run."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
