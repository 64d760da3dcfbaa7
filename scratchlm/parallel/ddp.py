"""Data parallelism with DistributedDataParallel: every process holds the whole model, its gradients and its
optimizer state, trains on its own slice of the global batch, and the gradients are averaged across processes
during the backward pass (NCCL between GPUs, Gloo between CPU processes), so every copy takes the same step.

It costs the most memory of the kinds (16 bytes a parameter with float32 weights and AdamW, on every process)
and the least communication: one all-reduce of the gradients a step, overlapped with the backward pass. The
gradients are views into DDP's communication buckets (`gradient_as_bucket_view`): without it DDP keeps a second
copy of every gradient in the buckets, 4 more bytes a parameter. The model is compiled whole, and wrapped
compiled.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.execution import Execution, ParallelSettings


def parallelize_ddp(model: TransformerLM, device: torch.device, settings: ParallelSettings) -> Execution:
    """`model` (compiled if `settings.compile`) wrapped for data-parallel training in a multi-process run. Every
    process holds the whole model in float32 (autocast lowers the matmuls) and nothing is resharded."""
    forward_model = torch.compile(model) if settings.compile else model
    device_ids = [device.index] if device.type == "cuda" else None
    train_model = DistributedDataParallel(forward_model, device_ids=device_ids, gradient_as_bucket_view=True)
    return Execution(forward_model, train_model, no_sync=train_model.no_sync)
