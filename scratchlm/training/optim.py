"""Optimizers written from the update rules: the toy SGD of the CS336 assignment-1 handout, and AdamW.

AdamW (Loshchilov & Hutter, 2019) keeps, per parameter, running averages of the gradient and of its square,

    m ← β1 m + (1 - β1) g          v ← β2 v + (1 - β2) g²
    α_t = α · sqrt(1 - β2^t) / (1 - β1^t)          (bias correction; t counts from 1)
    θ ← θ - α_t · m / (sqrt(v) + ε)
    θ ← θ - α λ θ                                   (decoupled weight decay)

Each rule is applied to all parameters of a group at once with `torch._foreach_*` kernels (a few launches per
step instead of a few per parameter), which is what makes the optimizer step cheap next to the model's
forward and backward passes. Both rules are elementwise: under FSDP each process applies them to its own shard
of every parameter (the state is made `zeros_like` the sharded parameter, so it is sharded alike).

`parameter_groups` splits a model's parameters into named groups by their role, which the model declares: the
hidden weight matrices, the token embeddings, the output head and the gains (the 1-D RMSNorm weights).
`scratchlm.training.optimizers` builds a run's optimizer over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from scratchlm.errors import ScratchlmError
from scratchlm.training.distributed import local

Params = Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]


def _check_positive(name: str, value: float, allow_zero: bool = True) -> None:
    if not (value >= 0 if allow_zero else value > 0):
        raise ScratchlmError(f"optimizer {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def evaluate_closure(closure: Callable[[], float] | None) -> float | None:
    """`Optimizer.step`'s optional closure, which re-evaluates the model and returns the loss, run with
    gradients enabled (the step itself runs under no_grad); None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SGD(torch.optim.Optimizer):
    """The handout's example: `θ ← θ - lr / sqrt(t + 1) · g`, with t the number of steps taken so far."""

    def __init__(self, params: Params, lr: float = 1e-3) -> None:
        _check_positive("lr", lr)
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state.get("t", 0)
                local(p).add_(local(p.grad), alpha=-group["lr"] / math.sqrt(t + 1))
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
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            adamw_update(group, self.state)
        return loss


def adamw_update(group: dict[str, Any], states: dict[torch.Tensor, dict[str, Any]]) -> None:
    """One AdamW step of the parameters of `group` (a `param_groups` entry with lr, betas, eps and
    weight_decay) that have a gradient; `states` holds each parameter's moments and step count."""
    params, grads, ms, vs, step_sizes = [], [], [], [], []
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise ScratchlmError("AdamW does not support sparse gradients")
        state = states[p]
        if not state:
            state["step"] = 0
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = state["step"]
        params.append(local(p))
        grads.append(local(p.grad))
        ms.append(local(state["m"]))
        vs.append(local(state["v"]))
        step_sizes.append(-lr * math.sqrt(1 - beta2**t) / (1 - beta1**t))
    if not params:
        return
    torch._foreach_lerp_(ms, grads, 1 - beta1)  # m + (1-β1)(g - m) = β1 m + (1-β1) g
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    denominators = torch._foreach_sqrt(vs)
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(params, ms, denominators, step_sizes)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)


#: The roles a parameter can have, in the order of `param_groups`.
PARAMETER_GROUPS = ("matrices", "embeddings", "head", "gains", "adapters")


def parameter_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The model's trainable parameters by role (`PARAMETER_GROUPS`), each parameter (a tied matrix too) in
    exactly one group. A model that knows its roles declares them (`TransformerLM.parameter_groups`: the
    embeddings, the head, the gains and the blocks' matrices); any other module has "gains" (its 1-D
    parameters) and "matrices" (the rest). Either way the groups are checked to hold every parameter of the
    model exactly once, so a parameter a model forgets to declare is an error here rather than one left
    untrained."""
    declare = getattr(model, "parameter_groups", None)
    if callable(declare):
        declared = declare()
    else:
        params = list(model.parameters())
        declared = {
            "matrices": [p for p in params if p.dim() >= 2],
            "gains": [p for p in params if p.dim() < 2],
        }
    unknown = sorted(set(declared) - set(PARAMETER_GROUPS))
    if unknown:
        raise ValueError(f"{type(model).__name__} declares unknown parameter groups {unknown}")
    _check_cover(model, declared)
    return {name: [p for p in declared.get(name, []) if p.requires_grad] for name in PARAMETER_GROUPS}


def _check_cover(model: torch.nn.Module, groups: dict[str, list[torch.nn.Parameter]]) -> None:
    """Every parameter of `model` (a shared one once) in exactly one of `groups`: a bug in the model if not."""
    seen: dict[int, str] = {}
    for name, params in groups.items():
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of {type(model).__name__} is in groups {seen[id(p)]} and {name}"
                )
            seen[id(p)] = name
    names = {id(p): name for name, p in model.named_parameters()}
    missing = [name for key, name in names.items() if key not in seen]
    foreign = len(set(seen) - set(names))
    problems = (["missing " + ", ".join(missing)] if missing else []) + (
        [f"{foreign} parameter(s) not of the model"] if foreign else []
    )
    if problems:
        raise ValueError(
            f"the parameter groups of {type(model).__name__} must hold each of its parameters once: "
            + "; ".join(problems)
        )
