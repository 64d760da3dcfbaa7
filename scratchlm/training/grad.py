"""Gradient clipping by the global L2 norm.

All gradients are treated as one long vector: `‖g‖ = sqrt(Σ_p ‖g_p‖²)`. When it exceeds `M`, every gradient is
scaled by `M / (‖g‖ + ε)` (ε = 1e-6 guards against division by zero), which keeps the direction of the update
and bounds its size — a cheap guard against the rare huge gradients that would throw training off course.

Under FSDP each process holds a shard of every gradient (a DTensor): it sums the squares of its shards, and
the sums are all-reduced, so every process finds the same global norm and scales its shards by the same
factor. A non-finite gradient anywhere makes the norm non-finite everywhere, so the processes also agree on
whether fp16's step overflowed (`scratchlm.training.loss_scale`).

The decision is made on the device (`torch.where`), not in Python, so clipping never waits for the GPU;
scaling by exactly 1.0 leaves a gradient bit for bit unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor
from torch.distributed.tensor import DTensor

from scratchlm.training.distributed import local

EPS = 1e-6


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float) -> Float[Tensor, ""]:
    """Scale the gradients in place so that their global L2 norm is at most `max_l2_norm`.

    Parameters without a gradient are skipped. Returns the total norm before clipping (a float32 0-d tensor
    on the gradients' device; call `.item()` only when you need the number).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sharded = any(isinstance(g, DTensor) for g in grads)
    grads = [local(g) for g in grads]
    device = grads[0].device
    norms = torch.stack([n.to(device=device, dtype=torch.float32) for n in torch._foreach_norm(grads)])
    if sharded:
        squares = norms.square().sum()
        dist.all_reduce(squares)
        total = squares.sqrt()
    else:
        total = torch.linalg.vector_norm(norms)
    scale = torch.where(total > max_l2_norm, max_l2_norm / (total + EPS), torch.ones_like(total))
    torch._foreach_mul_(grads, scale)
    return total
