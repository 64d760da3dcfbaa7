"""The processes of a training run, with `torch.distributed` (launched by torchrun).

torchrun starts one process per device and tells each, through environment variables, its `RANK` (0..W-1
over all machines), `LOCAL_RANK` (its device on this machine) and `WORLD_SIZE` (W). Each process trains on its
own slice of the global batch; how the model is spread over them (a whole copy each under DDP, a shard each
under FSDP) is `scratchlm.parallel`'s. Rank 0 alone writes logs and checkpoints. Started without torchrun, a
process is rank 0 of a world of one and none of this machinery is used.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scratchlm.errors import ScratchlmError


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> tuple[Distributed, torch.device]:
    """Join the process group torchrun set up (if any); returns the ranks and this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed(), device
    info = Distributed(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world_size)
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    elif device.type == "cpu":
        dist.init_process_group("gloo")
    else:
        raise ScratchlmError(f"multi-process training needs cuda or cpu devices, not {device.type}")
    return info, device


def shutdown_distributed(finished: bool) -> None:
    """Tear down the process group. After a normal finish every process first waits for the others (rank 0
    may still be writing the final checkpoint): a Gloo process that destroys its group while a peer still
    uses it aborts. After an error there is no waiting, since a failed peer would never arrive.

    The training objects are collected first: DistributedDataParallel's reducer holds the group's pending
    work, and freed only at interpreter exit, after the group, it can make Gloo's threads abort the process."""
    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def all_reduce(value: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """Combine a tensor over processes (a no-op for a world of one): op is "mean", "sum" or "max"."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op == "mean":
        value /= dist.get_world_size()
    return value


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of `tensor`: the local shard of a sharded DTensor (FSDP's parameters, gradients and
    optimizer state), which shares its storage, so that in-place updates of it update the DTensor; any other
    tensor as it is. The optimizers step on shards with it, elementwise and without DTensor's dispatch."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
