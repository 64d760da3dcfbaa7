"""Muon for the hidden weight matrices, AdamW for everything else, in one optimizer.

Muon (Jordan et al., 2024; modded-nanogpt, nanochat) keeps one momentum buffer per matrix and steps along the
*orthogonalised* momentum: the gradient's singular vectors with every singular value set to about 1. For a
gradient `G` of a `(rows, cols)` weight, with momentum μ and learning rate α:

    B ← μ B + (1 - μ) G                          (momentum buffer)
    M = (1 - μ) G + μ B                          (Nesterov look-ahead; M = B without it)
    O ≈ U Vᵀ  where  M = U Σ Vᵀ                  (Newton–Schulz, below)
    W ← W (1 - α λ)  -  α · sqrt(max(1, rows / cols)) · O

An AdamW step moves each weight on its own; a gradient matrix is usually dominated by a few directions, so
most of such a step goes into those. `U Vᵀ` moves the matrix by the same amount along every direction the
gradient has, which is steepest descent under the spectral norm, the natural norm of a linear map. The factor
`sqrt(rows / cols)` for tall matrices keeps the update's effect on the outputs comparable across shapes.

`U Vᵀ` is computed without an SVD by the quintic Newton–Schulz iteration of modded-nanogpt: after scaling `M`
to Frobenius norm 1 (so every singular value is at most 1),

    X ← a X + (b A + c A²) X    with    A = X Xᵀ,   (a, b, c) = (3.4445, -4.7750, 2.0315)

applies the polynomial `p(σ) = a σ + b σ³ + c σ⁵` to every singular value and leaves the singular vectors
alone. The coefficients make `p` rise as steeply as possible from 0, so five iterations bring every singular
value into about [0.7, 1.2] (not exactly 1: a spread that costs nothing measurable and saves iterations). Only
matrix products are used, so it runs in bfloat16 where the hardware multiplies bfloat16 natively. The
iteration multiplies by the smaller Gram matrix: a tall matrix is transposed first.

The optimizer is one `torch.optim.Optimizer`, so the training loop, checkpoints and the learning-rate schedule
treat it like AdamW: each parameter group carries an `algorithm` ("muon" or "adamw") and its own
hyperparameters. Embeddings, the output head and the gains stay with AdamW: an embedding row is a lookup, not a
linear map, and a gain is a vector (`scratchlm.training.optim.build_optimizer` makes the groups). Matrices of
one shape are orthogonalised together as one batch of matrix products. Under DistributedDataParallel the
gradients are already averaged across processes when `step()` runs, so every process computes the same update
on its own and the copies stay identical (tested). Under FSDP each process holds a shard of every matrix; the
momentum is elementwise and stays on the shards, but orthogonalising needs the whole matrix, so each matrix has
an owner process that gathers it, orthogonalises it and scatters the result back (`orthogonalise_sharded`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor
from torch.distributed.tensor import DTensor

from scratchlm.errors import ScratchlmError
from scratchlm.training.distributed import local
from scratchlm.training.optim import Params, _check_positive, adamw_update, evaluate_closure

NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The update rule of a parameter group, its "algorithm" entry. Plain strings, not an enum: the tag is saved with
# the optimizer's state, which checkpoints load with `weights_only=True` (plain values only).
MUON, ADAMW = "muon", "adamw"
Algorithm = Literal["muon", "adamw"]
ALGORITHMS: tuple[Algorithm, ...] = (MUON, ADAMW)


def newton_schulz(
    G: Float[Tensor, "... rows cols"], steps: int = 5, dtype: torch.dtype = torch.bfloat16
) -> Float[Tensor, "... rows cols"]:
    """`U Vᵀ` of `G = U Σ Vᵀ`, approximately (singular values in about [0.7, 1.2] after 5 steps), for each
    matrix of a batch; computed in `dtype` and returned in `G`'s dtype."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    tall = G.shape[-2] > G.shape[-1]
    X = G.to(dtype)
    if tall:
        X = X.mT
    # The Frobenius norm bounds the spectral norm: after this every singular value is in [0, 1].
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups whose `algorithm` is "muon" (2-D matrices only), AdamW for those whose
    `algorithm` is "adamw"; the update rules are in the module docstring and `scratchlm.training.optim`.

    `ns_dtype` is the Newton–Schulz iteration's dtype (`build_optimizer` gives bfloat16 where the run's
    precision is bf16).
    """

    def __init__(
        self,
        params: Params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        algorithm: Algorithm = MUON,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        _check_positive("lr", lr)
        _check_positive("eps", eps)
        _check_positive("weight_decay", weight_decay)
        if not 0 <= momentum < 1:
            raise ScratchlmError(f"Muon momentum must lie in [0, 1), got {momentum!r}")
        if ns_steps < 1:
            raise ScratchlmError(f"Muon needs at least one Newton–Schulz step, got {ns_steps}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ScratchlmError(f"optimizer betas must lie in [0, 1), got {tuple(betas)!r}")
        defaults = {
            "lr": lr, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "betas": tuple(betas),
            "eps": eps, "weight_decay": weight_decay, "algorithm": algorithm,
        }  # fmt: skip
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["algorithm"] not in ALGORITHMS:
                raise ScratchlmError(
                    f"parameter group algorithm must be one of {', '.join(ALGORITHMS)}, got {group['algorithm']!r}"
                )
            if group["algorithm"] == MUON and any(p.dim() != 2 for p in group["params"]):
                name = group.get("name", "a Muon group")
                raise ScratchlmError(
                    f"Muon orthogonalises matrices; {name} holds a parameter that is not 2-D"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            if group["algorithm"] == ADAMW:
                adamw_update(group, self.state)
            else:
                self._muon_update(group)
        return loss

    def _muon_update(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [local(p.grad) for p in params]
        buffers = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffers.append(local(state["momentum_buffer"]))
        momentum, lr = group["momentum"], group["lr"]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)  # B + (1-μ)(G - B) = μ B + (1-μ) G
        directions = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        weights = [local(p) for p in params]
        if group["weight_decay"]:
            torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
        if isinstance(params[0], DTensor):
            updates = orthogonalise_sharded(params, directions, group["ns_steps"], self.ns_dtype)
        else:
            updates = orthogonalise(directions, group["ns_steps"], self.ns_dtype)
        for indices in by_shape(params).values():
            rows, cols = params[indices[0]].shape  # one shape, so one step size
            torch._foreach_add_(
                [weights[i] for i in indices],
                [updates[i] for i in indices],
                alpha=-lr * max(1.0, rows / cols) ** 0.5,
            )


def by_shape(matrices: list[Tensor]) -> dict[tuple, list[int]]:
    """The indices of `matrices` grouped by (whole) shape and device."""
    groups: dict[tuple, list[int]] = {}
    for i, matrix in enumerate(matrices):
        groups.setdefault((matrix.shape, matrix.device), []).append(i)
    return groups


def orthogonalise(matrices: list[Tensor], steps: int, dtype: torch.dtype) -> list[Tensor]:
    """`newton_schulz` of each matrix; those of one shape as one batch."""
    result: list[Tensor] = list(matrices)
    for indices in by_shape(matrices).values():
        orthogonal = newton_schulz(torch.stack([matrices[i] for i in indices]), steps, dtype)
        for i, matrix in zip(indices, orthogonal.unbind(0), strict=True):
            result[i] = matrix
    return result


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """The rank that orthogonalises each of the matrices of `sizes` (their element counts): the largest first,
    each to the rank with the fewest elements so far (the lowest such rank on a tie). This greedy rule leaves
    the busiest rank at most 4/3 of the best possible load (Graham, 1969), and within one matrix of an even
    share when, as in a Transformer, the matrices come in many copies of a few sizes."""
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(world_size), key=lambda rank: (loads[rank], rank))
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


def orthogonalise_sharded(
    params: list[DTensor], directions: list[Tensor], steps: int, dtype: torch.dtype
) -> list[Tensor]:
    """The local shards of `newton_schulz` of the whole matrices of which `directions` are this process's
    shards (rows, as FSDP shards `params`: `Shard(0)`, ceil(rows / N) rows a process, the last ones fewer
    or none). Each matrix has an owner (`assign_owners`): its shards are gathered there, the owner
    orthogonalises its matrices, those of one shape as one batch, and scatters each result back as shards.
    The processes' work is split N ways, and a matrix crosses the network twice (against N times for an
    all-gather to every process)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    owners = assign_owners([p.numel() for p in params], world)
    # The rows a shard holds, padded to the largest shard's: gather and scatter move tensors of equal sizes.
    chunks = [-(-p.shape[0] // world) for p in params]

    def padded(shard: Tensor, i: int) -> Tensor:
        out = shard.new_zeros(chunks[i], shard.shape[1])
        out[: shard.shape[0]] = shard
        return out

    received: dict[int, list[Tensor]] = {}
    pending = []
    for i, direction in enumerate(directions):
        if owners[i] == rank:
            received[i] = [direction.new_empty(chunks[i], direction.shape[1]) for _ in range(world)]
        pending.append(dist.gather(padded(direction, i), received.get(i), dst=owners[i], async_op=True))
    for work in pending:
        work.wait()
    mine = sorted(received)
    whole = [torch.cat(received[i])[: params[i].shape[0]] for i in mine]
    orthogonal = dict(zip(mine, orthogonalise(whole, steps, dtype), strict=True))

    updates, pending = [], []
    for i, direction in enumerate(directions):
        out = direction.new_empty(chunks[i], direction.shape[1])
        parts = None
        if i in orthogonal:
            full = orthogonal[i].new_zeros(chunks[i] * world, direction.shape[1])
            full[: params[i].shape[0]] = orthogonal[i]
            parts = list(full.split(chunks[i]))
        pending.append(dist.scatter(out, parts, src=owners[i], async_op=True))
        updates.append(out[: direction.shape[0]])
    for work in pending:
        work.wait()
    return updates
