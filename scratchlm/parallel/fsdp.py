"""Fully sharded data parallelism with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Every parameter is split along its first dimension into one shard per process (a `DTensor` with placement
`Shard(0)`); the gradients and the optimizer state (made `zeros_like` the parameters) are sharded with it, so
each of N processes holds 1/N of the 16 bytes a parameter that float32 weights and AdamW take. The price is
communication: before a module's forward (and again before its backward) its parameters are all-gathered into
whole tensors, used, and freed; after its backward its gradients are reduce-scattered, each process keeping
the average over processes of its own shard. Each Transformer block is one unit of this (`fully_shard` on
each), so only a block or two have their whole parameters at a time, and (on a GPU) the gather of the next
block overlaps the compute of this one; the root unit holds the rest: the token and value embeddings, the U-net weights, the
final norm and the LM head.

Mixed precision is the device plan's: under bf16 or fp16 each block's parameters are gathered in the compute
dtype (half the bytes to move) and its gradients reduced in float32 (`MixedPrecisionPolicy`); autocast, which
the step runs the forward in as without sharding, still decides which operations compute in the low
precision. The root is gathered in float32: the embeddings' rows, and so the residual stream, then stay float32
as they are without sharding (autocast lowers the matmuls only, not the additions), and the root holds a small
share of a large model's parameters. `reshard_after_forward` frees the gathered blocks after the forward (gathering
them again for the backward) to save memory; false keeps them until the backward, trading memory for
communication. The root's are always kept: its backward follows its forward at once.

Gradients are reduce-scattered after every micro-batch, in float32 into the float32 shards: skipping the
reduction until the last micro-batch would add them up whole, in the compute dtype, on every process. Compiled,
each block is compiled on its own before it is sharded (as torchtitan does), so the gathers stay outside the
compiled code.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.execution import Execution, ParallelSettings


def parallelize_fsdp(model: TransformerLM, device: torch.device, settings: ParallelSettings) -> Execution:
    """Shard `model` in place across the `settings.world_size` processes (each block, compiled if
    `settings.compile`, then the root), its blocks gathered in `settings.compute_dtype`: its parameters become
    DTensor shards, so make the optimizer after this."""
    if settings.compile:
        for block in model.layers:
            block.compile()
    shard(model, device, settings)
    return Execution(model, model, lockstep=True)


def shard(model: TransformerLM, device: torch.device, settings: ParallelSettings) -> None:
    """`fully_shard` each block of `model`, then the root, over a mesh of the `settings.world_size` processes."""
    mesh = init_device_mesh(device.type, (settings.world_size,))
    low = settings.compute_dtype if settings.compute_dtype != torch.float32 else None
    # cast_forward_inputs=False: the residual stream enters each block in float32, as without sharding.
    blocks = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=blocks, reshard_after_forward=settings.reshard_after_forward)
    root = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root, reshard_after_forward=False)
