"""Sharded checkpoints: what a run whose model is sharded across processes (`training.parallel = "fsdp"`) saves,
and how any process count, or one process alone, reads it back.

A sharded checkpoint is a directory beside where the single file would be, written with PyTorch's Distributed
Checkpoint (DCP, `torch.distributed.checkpoint`):

    checkpoints/step_00001000/
      .metadata            DCP's index: every tensor's shape and chunks, and the file and bytes each chunk is in
      __0_0.distcp, ...    the shards, one file per process: its pieces of the model and the optimizer state
      checkpoint.pt        every other entry of a checkpoint (`scratchlm.run.checkpoint`): step, model config,
                           training config, RNG and data-sampling states, time, budget, loss scale, processes,
                           tokenizer fingerprint; written by rank 0, with its checksum

The model and optimizer are taken with `get_state_dict` (the optimizer's state keyed by parameter name, not by
position), so DCP can reshard them: a checkpoint saved by N processes loads into M, each reading only the
chunks of its own shards, or into an unsharded model, which reads whole tensors.

Saving is collective and atomic. Every process writes into `step_N.tmp-ID/`; once all have finished (a barrier),
rank 0 renames it to `step_N/`. A process killed mid-save leaves only the temporary, which no reader looks at and
the next save removes: a resume finds the previous complete checkpoint. A directory whose index or state file is
missing, or whose index names a shard that is missing or short, is refused by name (`check_complete`), and a
resume falls back to the newest intact checkpoint.

`consolidate` reads one in a single process with no process group, into the same `Checkpoint` a single file
gives, so `generate`, `eval`, `serve`, `chat`, `sft`, `export` and `training.init_from` read either kind;
`load_shards` reads one into a live model, each process its own shards (a resume). Which kind a path is, and
which of these reads it, is decided in `scratchlm.run.load`, the one way in.
DCP's index and its non-tensor entries are pickles: like any DCP checkpoint, read only ones you trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scratchlm.errors import ScratchlmError
from scratchlm.run.checkpoint import MODEL, OPTIMIZER, Checkpoint, strip_wrapper_prefixes

STATE_FILE = "checkpoint.pt"  # the entries other than the model and the optimizer (rank 0)
INDEX_FILE = ".metadata"  # DCP's


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a sharded checkpoint's directory (complete or not), rather than a run directory."""
    path = Path(path)
    return path.is_dir() and ((path / INDEX_FILE).exists() or (path / STATE_FILE).exists())


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _is_distributed():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """Without a process group DCP saves and loads in this process alone, as meant, but warns each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _shared_token() -> str:
    """A name part that every process agrees on (rank 0's)."""
    token = [uuid.uuid4().hex[:12]]
    if _is_distributed():
        dist.broadcast_object_list(token, src=0)
    return token[0]


# torch.distributed.checkpoint is imported where it is used: it takes seconds to import, and the commands that
# read a checkpoint need it only for a sharded one.


def save_sharded(
    checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path
) -> Path:
    """Write the sharded checkpoint `path` (a directory): every process calls this, with the live (sharded or
    not) `model` and `optimizer`, whose state it writes; `checkpoint` gives the other entries (its own model and
    optimizer fields are not used). Returns once the checkpoint is complete under its name on every process."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank() if _is_distributed() else 0
    tmp = path.with_name(f"{path.name}.tmp-{_shared_token()}")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    write_shards({MODEL: model_state, OPTIMIZER: optimizer_state}, tmp)
    if rank == 0:
        dataclasses.replace(checkpoint, model={}, optimizer=None).save(tmp / STATE_FILE)
    _barrier()  # every process has written its shards: only now is the directory complete
    if rank == 0:
        _publish(tmp, path)
    _barrier()  # nobody goes on (or prunes, or stops) before it is there
    return path


def write_shards(state: dict[str, Any], directory: Path) -> None:
    """DCP's collective save of `state` into `directory` (each process its shards; rank 0 the index)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quietly():
        dcp.save(state, checkpoint_id=directory, no_dist=not _is_distributed())


def _publish(tmp: Path, path: Path) -> None:
    """Rename the finished `tmp` to `path` (replacing a checkpoint of the same step), durably."""
    if path.exists():  # the same step saved again: the new one replaces it
        old = path.with_name(f"{path.name}.tmp-old-{uuid.uuid4().hex[:12]}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


def check_complete(path: str | os.PathLike) -> None:
    """Refuse, with one line naming what is missing, a sharded checkpoint that is not whole: its index or state
    file missing, or a shard file its index names missing or shorter than the bytes it should hold."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    for name in (INDEX_FILE, STATE_FILE):
        if not (path / name).is_file():
            raise ScratchlmError(f"sharded checkpoint {path} is incomplete: {name} is missing")
    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ScratchlmError(f"sharded checkpoint {path} has an unreadable {INDEX_FILE}: {reason}") from None
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise ScratchlmError(f"sharded checkpoint {path} is incomplete: its shard {name} is missing")
        if shard.stat().st_size < size:
            raise ScratchlmError(
                f"sharded checkpoint {path} is damaged: its shard {name} has {shard.stat().st_size} bytes "
                f"of {size}"
            )


def read_state(path: str | os.PathLike) -> Checkpoint:
    """A complete sharded checkpoint's entries other than the model and optimizer (checked: `check_complete`),
    as a `Checkpoint` whose model is empty and whose `shards` is `path`: what a resume reads before each
    process loads its shards (`load_shards`)."""
    check_complete(path)
    return dataclasses.replace(Checkpoint.read(Path(path) / STATE_FILE), shards=Path(path))


def consolidate(path: str | os.PathLike) -> Checkpoint:
    """The whole checkpoint of the sharded checkpoint `path`, read in this process alone (no process group,
    every shard read): the model as full tensors and the optimizer state in a single file's layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = read_state(path)
    state: dict[str, Any] = {}
    # What `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` does, without writing the file: every
    # entry the index lists, rebuilt into the nested dicts that were saved.
    _load_state_dict(
        state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    optimizer = state.get(OPTIMIZER)
    return dataclasses.replace(
        checkpoint,
        model=strip_wrapper_prefixes(state[MODEL]),
        optimizer=optimizer_by_position(optimizer) if optimizer else None,
        shards=None,
    )


def load_shards(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load the sharded checkpoint `path` into `model` (and `optimizer`) however they are laid out now (sharded
    over any number of processes, or whole): each process reads the chunks its shards need. Collective when a
    process group is running."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    # The layout to fill: DCP reads into it what each process's shards need (only the model's without an
    # optimizer).
    if optimizer is None:
        state = {MODEL: get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {MODEL: model_state, OPTIMIZER: optimizer_state}
    try:
        with _single_process_quietly():
            dcp.load(state, checkpoint_id=path, no_dist=not _is_distributed())
    except Exception as e:  # DCP reports a mismatch of names or shapes in several ways
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ScratchlmError(f"sharded checkpoint {path} does not fit the model: {reason}") from None
    if optimizer is None:
        set_model_state_dict(model, state[MODEL])
    else:
        set_state_dict(model, optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIMIZER])


def set_full_state(
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    """Load whole tensors (a single file's, or a consolidated checkpoint's) into the sharded `model` (and
    `optimizer`, from `optimizer_state` in `torch.optim.Optimizer.state_dict`'s layout) through
    `set_state_dict`: each process keeps its shards of them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    if optimizer is None or optimizer_state is None:
        set_model_state_dict(model, model_state, options=whole)
        return
    names = [
        name
        for group in get_optimizer_state_dict(model, optimizer)["param_groups"]
        for name in group["params"]
    ]
    named = optimizer_by_name(optimizer_state, names)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=named, options=whole)


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are sharded (DTensors: `fully_shard`)."""
    # Only a process that imported torch.distributed.tensor can hold DTensors; importing it to find out would
    # cost inference (`generate`, `eval`) seconds.
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


def optimizer_by_position(named: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (`get_state_dict`'s) in `torch.optim.Optimizer.state_dict`'s
    layout: parameters numbered 0, 1, ... through the groups in order, as that method numbers them."""
    position = {name: i for i, name in enumerate(n for g in named["param_groups"] for n in g["params"])}
    return {
        "state": {
            position[name]: value
            for name, value in sorted(named["state"].items(), key=lambda kv: position[kv[0]])
        },
        "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in named["param_groups"]],
    }


def optimizer_by_name(positional: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `optimizer_by_position`, given the parameters' names in position order."""
    return {
        "state": {names[i]: value for i, value in positional["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in positional["param_groups"]
        ],
    }
