"""The `[optimizer]` section and the registry of optimizers it names: the one place a run's optimizer is made.

`build_optimizer` splits the model's parameters into the groups the model declares (`parameter_groups`: the
hidden matrices, the embeddings, the head, the gains). Every group is a `param_groups` entry with its `name`,
an `lr_scale` (its learning rate is the schedule's rate times this) and its own hyperparameters, so an
optimizer or a rate per group is a matter of configuration: `embedding_lr` / `head_lr` give those groups rates
of their own, and `name = "muon"` gives the hidden matrices to Muon and the rest to AdamW.

A new optimizer is one builder, `(config, groups, precision) -> torch.optim.Optimizer`, and one line in
`OPTIMIZERS`; `optimizer.name` accepts every key of the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from scratchlm.training.muon import ADAMW, MUON, Muon
from scratchlm.training.optim import SGD, AdamW, parameter_groups

Groups = list[dict[str, Any]]


def build_sgd(config: OptimizerConfig, groups: Groups, precision: str) -> torch.optim.Optimizer:
    return SGD(groups, lr=config.lr)


def build_adamw(config: OptimizerConfig, groups: Groups, precision: str) -> torch.optim.Optimizer:
    return AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)


def build_muon(config: OptimizerConfig, groups: Groups, precision: str) -> torch.optim.Optimizer:
    """Muon for the "matrices" group, AdamW for the others; the Newton–Schulz iteration in bfloat16 when the
    run's resolved `precision` is bf16 and `config.muon_bf16`, else in float32."""
    for group in groups:
        group["algorithm"] = MUON if group["name"] == "matrices" else ADAMW
        if group["name"] == "matrices":
            group["weight_decay"] = config.muon_weight_decay
    return Muon(
        groups,
        lr=config.lr,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        ns_steps=config.muon_ns_steps,
        ns_dtype=torch.bfloat16 if config.muon_bf16 and precision == "bf16" else torch.float32,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


#: `optimizer.name` -> its builder.
OPTIMIZERS: dict[str, Callable[[OptimizerConfig, Groups, str], torch.optim.Optimizer]] = {
    "adamw": build_adamw,
    "sgd": build_sgd,
    "muon": build_muon,
}
OptimizerName = Literal[tuple(OPTIMIZERS)]  # the config accepts exactly the registered names


@dataclass(frozen=True)
class OptimizerConfig:
    # adamw | sgd: one algorithm for every parameter. muon: Muon for the hidden weight matrices (muon_* below),
    # AdamW (lr, betas, eps, weight_decay) for the token embeddings, the LM head and the gains.
    name: OptimizerName = "adamw"
    lr: float = 1e-3  # peak learning rate α_max (of every group without a rate of its own below)
    min_lr: float = 1e-4  # final rate α_min; a group with a rate of its own ends at that rate × min_lr / lr
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # AdamW's decoupled weight decay λ (θ ← θ (1 - α λ))
    grad_clip: float = 1.0  # maximum global gradient L2 norm; 0 disables clipping
    embedding_lr: float = 0.0  # peak rate of the token and value embeddings; 0: lr
    head_lr: float = 0.0  # peak rate of the LM head (untied); 0: lr
    muon_lr: float = 0.02  # name = "muon": peak rate of the hidden matrices
    muon_momentum: float = 0.95  # Muon's momentum μ
    muon_nesterov: bool = True  # Nesterov momentum: orthogonalise (1 - μ) g + μ B rather than B
    muon_ns_steps: int = 5  # Newton–Schulz iterations of the orthogonalisation
    muon_bf16: bool = True  # iterate in bfloat16 when training.precision resolves to bf16; false: float32
    muon_weight_decay: float = 0.0  # Muon's decoupled weight decay of the hidden matrices


def build_optimizer(
    config: OptimizerConfig, model: torch.nn.Module, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """The optimizer `config` names over `model`'s parameter groups; groups without parameters are left out.
    A group's peak rate is `config.lr` unless the config gives it its own (`embedding_lr`, `head_lr`, and
    `muon_lr` for the matrices under Muon); its `lr_scale` is that rate over `config.lr`, so the schedule
    moves every group's rate in proportion. The CS336 assignment-1 handout's recipe gives every group the same
    settings."""
    rates = {
        "matrices": config.muon_lr if config.name == "muon" else config.lr,
        "embeddings": config.embedding_lr or config.lr,
        "head": config.head_lr or config.lr,
        "gains": config.lr,
        "adapters": config.lr,  # LoRA's factors (AdamW's under Muon too: they are not orthogonalised)
    }
    groups = [
        {"params": params, "name": name, "lr_scale": rates[name] / config.lr}
        for name, params in parameter_groups(model).items()
        if params
    ]
    return OPTIMIZERS[config.name](config, groups, precision)
