"""A sharded model's whole state in one process: gathered to rank 0 for the single-file checkpoint, and
spread from it again to the shards when a run resumes.

The single-file checkpoint (`scratchlm.run.checkpoint`) holds the model's state dict and the optimizer's, as
`state_dict()` gives them without sharding: the optimizer's parameters are numbered in the order of its
parameter groups. Under FSDP, `torch.distributed.checkpoint.state_dict` gathers every shard into whole tensors
(one tensor at a time, onto rank 0's CPU memory), naming the optimizer's parameters by their state-dict names;
the numbering is restored here, so the file is the same whichever way the run trained, and a run may resume
under either. Loading distributes each process's share of the whole tensors it has read.

Without sharding, both are the plain `state_dict` / `load_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from scratchlm.errors import ScratchlmError
from scratchlm.run.checkpoint import Checkpoint, strip_wrapper_prefixes, unwrap_model


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dicts of `model` and `optimizer`, whole. Under sharding every process must call this (it
    gathers), and only rank 0 receives them: the others get empty dicts."""
    if not is_sharded(model):
        return unwrap_model(model).state_dict(), optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if not optimizer_state:  # a rank other than 0
        return model_state, optimizer_state
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    return model_state, {
        "state": {number[name]: state for name, state in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [number[name] for name in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }


def load_full_state(
    checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load `checkpoint`'s model (and optimizer) state into `model` (and `optimizer`), sharded or not."""
    if not is_sharded(model):
        checkpoint.load_into(model, optimizer)
        return
    model_state = strip_wrapper_prefixes(checkpoint.model)
    options = StateDictOptions(full_state_dict=True)
    try:
        if optimizer is None:
            set_model_state_dict(model, model_state, options=options)
            return
        if checkpoint.optimizer is None:
            raise ScratchlmError(
                "checkpoint has no optimizer state (an imported model): start a new run from it"
            )
        names = {id(p): name for name, p in model.named_parameters()}
        name_of = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        saved = checkpoint.optimizer
        optimizer_state = {
            "state": {name_of[i]: state for i, state in saved["state"].items()},
            "param_groups": [
                {**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]
            ],
        }
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )
        # Each group's settings exactly as saved, as `load_state_dict` leaves them (DCP turns tuples into lists).
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
    except (RuntimeError, KeyError, IndexError) as e:
        raise ScratchlmError(f"checkpoint does not fit the model: {e}") from None
