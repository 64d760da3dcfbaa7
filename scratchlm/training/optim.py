"""Optimizers written from the update rules: the handout's toy SGD and AdamW.

AdamW (Loshchilov & Hutter, 2019) keeps, per parameter, running averages of the gradient and of its square,

    m ← β1 m + (1 - β1) g          v ← β2 v + (1 - β2) g²
    α_t = α · sqrt(1 - β2^t) / (1 - β1^t)          (bias correction; t counts from 1)
    θ ← θ - α_t · m / (sqrt(v) + ε)
    θ ← θ - α λ θ                                   (decoupled weight decay)

Each rule is applied to all parameters of a group at once with `torch._foreach_*` kernels (a few launches per
step instead of a few per parameter), which is what makes the optimizer step cheap next to the model's
forward and backward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from scratchlm.errors import ScratchlmError

Params = Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]


def _check_positive(name: str, value: float, allow_zero: bool = True) -> None:
    if not (value >= 0 if allow_zero else value > 0):
        raise ScratchlmError(f"optimizer {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


class SGD(torch.optim.Optimizer):
    """The handout's example: `θ ← θ - lr / sqrt(t + 1) · g`, with t the number of steps taken so far."""

    def __init__(self, params: Params, lr: float = 1e-3) -> None:
        _check_positive("lr", lr)
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state.get("t", 0)
                p.add_(p.grad, alpha=-group["lr"] / math.sqrt(t + 1))
                state["t"] = t + 1
        return loss


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay, exactly the update rule in the module docstring."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        _check_positive("lr", lr)
        _check_positive("eps", eps)
        _check_positive("weight_decay", weight_decay)
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ScratchlmError(f"optimizer betas must lie in [0, 1), got {tuple(betas)!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, ms, vs, step_sizes = [], [], [], [], []
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ScratchlmError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                params.append(p)
                grads.append(p.grad)
                ms.append(state["m"])
                vs.append(state["v"])
                step_sizes.append(-lr * math.sqrt(1 - beta2**t) / (1 - beta1**t))
            if not params:
                continue
            torch._foreach_lerp_(ms, grads, 1 - beta1)  # m + (1-β1)(g - m) = β1 m + (1-β1) g
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
            denominators = torch._foreach_sqrt(vs)
            torch._foreach_add_(denominators, eps)
            torch._foreach_addcdiv_(params, ms, denominators, step_sizes)
            if weight_decay:
                torch._foreach_mul_(params, 1 - lr * weight_decay)
        return loss
