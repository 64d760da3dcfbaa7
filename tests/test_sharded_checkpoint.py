"""Sharded checkpoints (`scratchlm.run.sharded`): written by every process of a model sharded with FSDP2
(`torch.distributed.fsdp.fully_shard`, per block then the root) into a directory, and read back by any number
of processes, or consolidated by one.

The processes are real: spawned, joined over Gloo on 127.0.0.1, each holding its shards of a tiny
`TransformerLM` trained a few steps with the project's AdamW. The oracle of every load is the full state the
saving processes gathered (`full_state_dict`) just after saving, compared bit for bit.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scratchlm.cli import main
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run import Checkpoint, RunDirectory, TrainingState, load_trained, sharded
from scratchlm.run.load import load_checkpoint, read_any
from scratchlm.training.config import TrainConfig
from scratchlm.training.distributed import Distributed
from scratchlm.training.optimizers import OptimizerConfig, build_optimizer
from scratchlm.training.start import layout_change, restore

MODEL = ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4)
STEPS = 3


def build(world: int) -> tuple[TransformerLM, torch.optim.Optimizer]:
    """The model (sharded over `world` processes when several: each block, then the root) and its AdamW."""
    torch.manual_seed(0)
    model = TransformerLM(MODEL)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    return model, build_optimizer(OptimizerConfig(lr=1e-2), model)


def fixed_input() -> torch.Tensor:
    return torch.randint(
        0, MODEL.vocab_size, (4, MODEL.context_length), generator=torch.Generator().manual_seed(1)
    )


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int, rank: int) -> None:
    """A few steps on this process's share of a fixed batch."""
    inputs = fixed_input()
    mine = inputs.chunk(world)[rank]
    for _ in range(STEPS):
        logits = model(mine[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state, keyed by name (collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {"model": model_state, "optimizer": optimizer_state}


def assert_identical(a, b, where: str = "") -> None:
    """Equal values, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def config(tmp: Path) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "data": {"train": "train.npy", "valid": "valid.npy"},  # never read here
            "model": MODEL.to_dict(),
            "training": {"parallel": "fsdp", "device": "cpu", "precision": "fp32", "max_steps": 10},
            "logging": {"run_dir": str(tmp / "run")},
        }
    )


def checkpoint_fields(tmp: Path, step: int, world: int) -> Checkpoint:
    """The entries beside the model and the optimizer, as a training run records them."""
    training = TrainingState(
        config=config(tmp).to_dict(),
        data_rng=np.random.default_rng(step).bit_generator.state,
        torch_rng=torch.get_rng_state(),
        world_size=world,
    )
    return Checkpoint({}, step, MODEL, training=training)


# --- the processes -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(world: int, scenario: str, tmp: Path, timeout: float = 240) -> list[int | None]:
    """Run `scenario` in `world` spawned processes joined over Gloo; their exit codes (-9: killed by SIGKILL).
    A process that raised leaves its traceback in `tmp/error-RANK.txt`."""
    port, context = free_port(), mp.get_context("spawn")
    processes = [
        context.Process(target=_process, args=(r, world, port, scenario, str(tmp))) for r in range(world)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout)
    for p in processes:
        if p.is_alive():  # a process a failed peer left waiting
            p.kill()
            p.join()
    return [p.exitcode for p in processes]


def check_processes(world: int, scenario: str, tmp: Path) -> None:
    codes = run_processes(world, scenario, tmp)
    errors = [(tmp / f"error-{r}.txt").read_text() for r in range(world) if (tmp / f"error-{r}.txt").exists()]
    assert codes == [0] * world, "\n".join(errors) or codes


def _process(rank: int, world: int, port: int, scenario: str, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        SCENARIOS[scenario](rank, world, Path(tmp))
        dist.barrier()
    except BaseException:
        (Path(tmp) / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    dist.destroy_process_group()


def save_then_load(rank: int, world: int, tmp: Path) -> None:
    """Train, save a sharded checkpoint, record the full state it holds and the logits; then load it, and the
    one-process checkpoint, into freshly sharded models."""
    model, optimizer = build(world)
    train_steps(model, optimizer, world, rank)
    path = RunDirectory(tmp / "run").checkpoint(STEPS, sharded=True)
    sharded.save_sharded(checkpoint_fields(tmp, STEPS, world), model, optimizer, path)
    saved = full_state(model, optimizer)
    with torch.no_grad():
        logits = model(fixed_input())
    if rank == 0:
        torch.save({"state": saved, "logits": logits}, tmp / "saved-by-2.pt")
    for source, reference in ((path, saved), (tmp / "one" / "step_00000003", None)):
        fresh, fresh_optimizer = build(world)
        load_checkpoint(source, fresh, fresh_optimizer)
        if reference is None:
            reference = torch.load(tmp / "saved-by-1.pt", weights_only=True)["state"]
        assert_identical(full_state(fresh, fresh_optimizer), reference, str(source))
    fresh, fresh_optimizer = build(world)  # a single file (a DDP run's) into a sharded model
    load_checkpoint(tmp / "one.pt", fresh, fresh_optimizer)
    assert_identical(full_state(fresh, fresh_optimizer), torch.load(tmp / "saved-by-1.pt")["state"], "one.pt")


def load_at_four(rank: int, world: int, tmp: Path) -> None:
    for source, oracle in (
        ("run/checkpoints/step_00000003", "saved-by-2.pt"),
        ("one/step_00000003", "saved-by-1.pt"),
    ):
        model, optimizer = build(world)
        load_checkpoint(tmp / source, model, optimizer)
        assert_identical(
            full_state(model, optimizer), torch.load(tmp / oracle, weights_only=True)["state"], source
        )


def killed_while_saving(rank: int, world: int, tmp: Path) -> None:
    """Save a complete checkpoint at step 3, then, at step 4, rank 1 is killed (SIGKILL) once its shards are
    written, before the others know it finished."""
    model, optimizer = build(world)
    train_steps(model, optimizer, world, rank)
    run = RunDirectory(tmp / "run")
    sharded.save_sharded(checkpoint_fields(tmp, STEPS, world), model, optimizer, run.checkpoint(STEPS, True))
    train_steps(model, optimizer, world, rank)
    if rank == 1:
        write = sharded.write_shards

        def write_then_die(state, directory):
            write(state, directory)
            (tmp / "rank-1-wrote-its-shards").touch()
            os.kill(os.getpid(), signal.SIGKILL)

        sharded.write_shards = write_then_die
    sharded.save_sharded(checkpoint_fields(tmp, 4, world), model, optimizer, run.checkpoint(4, True))


SCENARIOS = {"save_then_load": save_then_load, "load_at_four": load_at_four, "killed": killed_while_saving}


# --- the tests -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A one-process sharded checkpoint (`one/step_00000003`, no process group) and single file (`one.pt`),
    then two processes: theirs (`run/checkpoints/step_00000003`), each loaded by the other's count."""
    tmp = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    model, optimizer = build(1)
    train_steps(model, optimizer, 1, 0)
    sharded.save_sharded(checkpoint_fields(tmp, STEPS, 1), model, optimizer, tmp / "one" / "step_00000003")
    fields = checkpoint_fields(tmp, STEPS, 1)
    Checkpoint.of(model, STEPS, optimizer=optimizer.state_dict(), training=fields.training).save(
        tmp / "one.pt"
    )
    torch.save({"state": full_state(model, optimizer)}, tmp / "saved-by-1.pt")
    check_processes(2, "save_then_load", tmp)  # 2 -> 2, 1 -> 2 and a file -> 2, checked in the processes
    return tmp


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_loads_at_one_two_and_four(saved):
    path = saved / "run" / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "checkpoint.pt",
    ]
    reference = torch.load(saved / "saved-by-2.pt", weights_only=True)["state"]
    model, optimizer = build(1)  # 2 -> 1: a whole model, no process group
    load_checkpoint(path, model, optimizer)
    assert_identical(full_state(model, optimizer), reference)
    check_processes(4, "load_at_four", saved)  # 2 -> 4 and 1 -> 4


@pytest.mark.slow
def test_every_command_reads_a_sharded_checkpoint_consolidated(saved, tmp_path, capsys):
    path = saved / "run" / "checkpoints" / "step_00000003"
    oracle = torch.load(saved / "saved-by-2.pt", weights_only=True)
    trained = load_trained(saved / "run")  # the run's latest checkpoint: the directory
    assert trained.checkpoint == path
    torch.testing.assert_close(trained.model(fixed_input()), oracle["logits"], rtol=0, atol=0)
    assert_identical(load_trained(path).model.state_dict(), oracle["state"]["model"])

    out = tmp_path / "single.pt"
    assert main(["export", "--run", str(saved / "run"), "--format", "checkpoint", "--out", str(out)]) == 0
    assert f"wrote {out}" in " ".join(capsys.readouterr().err.split())
    # Today's format: the optimizer by position, as optimizer.state_dict() has it.
    single = Checkpoint.read(out)
    model, optimizer = build(1)
    load_checkpoint(single, model, optimizer)
    assert_identical(full_state(model, optimizer), oracle["state"])
    assert single.step == STEPS and single.training.world_size == 2
    assert single.training.config == config(saved).to_dict()


@pytest.mark.slow
def test_a_missing_shard_is_refused_by_name_and_resume_falls_back(saved, tmp_path, capsys):
    run = RunDirectory(tmp_path / "run")
    run.checkpoints_dir.mkdir(parents=True)
    older, newer = run.checkpoint(3, True), run.checkpoint(5, True)
    for copy in (older, newer):
        os.system(f"cp -r {saved / 'run' / 'checkpoints' / 'step_00000003'} {copy}")
    (newer / "__1_0.distcp").unlink()

    with pytest.raises(ScratchlmError) as refused:
        read_any(newer)
    message = str(refused.value)
    assert "\n" not in message and str(newer) in message and "__1_0.distcp is missing" in message
    assert main(["generate", "--checkpoint", str(newer), "--prompt", "a"]) != 0
    assert "__1_0.distcp is missing" in capsys.readouterr().err

    model, optimizer = build(1)
    progress = restore(
        config(tmp_path), run, model, optimizer, torch.device("cpu"), Distributed(), resume=True
    )
    printed = " ".join(capsys.readouterr().err.split())
    assert progress.step == STEPS and f"resuming from {older}" in printed
    assert run.checkpoints() == [older] and (run.checkpoints_dir / "step_00000005.damaged").is_dir()
    reference = torch.load(saved / "saved-by-2.pt", weights_only=True)["state"]
    assert_identical(full_state(model, optimizer), reference)
    # saved by 2 processes, resumed by 1: said so
    assert "saved by 2 processes under parallel = 'fsdp'; resuming with 1 process" in printed


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_for_resume(tmp_path, capsys):
    codes = run_processes(2, "killed", tmp_path, timeout=120)
    assert codes[1] == -signal.SIGKILL and (tmp_path / "rank-1-wrote-its-shards").exists(), codes
    run = RunDirectory(tmp_path / "run")
    partial = [p for p in run.checkpoints_dir.iterdir() if ".tmp-" in p.name]
    assert [p.name.split(".")[0] for p in partial] == ["step_00000004"]  # written, never renamed
    assert (partial[0] / "__1_0.distcp").exists()
    assert run.checkpoints() == [run.checkpoint(3, True)]

    model, optimizer = build(1)
    progress = restore(
        config(tmp_path), run, model, optimizer, torch.device("cpu"), Distributed(), resume=True
    )
    assert progress.step == STEPS
    assert f"resuming from {run.checkpoint(3, True)}" in " ".join(capsys.readouterr().err.split())
    run.prune_checkpoints(keep=3)  # the next save's pruning removes what the crash left
    assert [p.name for p in run.checkpoints_dir.iterdir()] == ["step_00000003"]


def test_a_sharded_run_of_one_process_resumes_exactly_and_keeps_its_newest(tmp_path):
    """`training.parallel = "fsdp"` in a world of one: the checkpoints are directories (no process group),
    `checkpoint.keep` prunes them, and a resume continues bit for bit."""
    from test_trainer import small_config

    from scratchlm.training.trainer import train

    train(small_config(tmp_path, "straight"))
    stopped = small_config(tmp_path, "sharded", training={"parallel": "fsdp", "max_steps": 8})
    train(stopped)
    run = RunDirectory(tmp_path / "sharded")
    assert run.checkpoints() == [run.checkpoint(4, True), run.checkpoint(8, True)]
    train(small_config(tmp_path, "sharded", training={"parallel": "fsdp"}), resume=True)
    assert run.checkpoints() == [run.checkpoint(8, True), run.checkpoint(12, True)]  # keep = 2
    whole = Checkpoint.read(tmp_path / "straight" / "checkpoints" / "step_00000012.pt")
    resumed = read_any(run.checkpoint(12, True))
    assert_identical(resumed.model, whole.model)
    assert_identical(resumed.optimizer, whole.optimizer)


def test_one_way_loads_a_sharded_checkpoint_with_or_without_the_optimizer(tmp_path):
    """`load_checkpoint` reads a sharded checkpoint (written by one process, no process group) into a fresh
    model, alone or with its optimizer, to the state that was saved, bit for bit; `read_any` gives the same
    model consolidated, and, not whole, the entries beside it with the shards left where they are."""
    model, optimizer = build(1)
    train_steps(model, optimizer, 1, 0)
    path = tmp_path / "step_00000003"
    sharded.save_sharded(checkpoint_fields(tmp_path, STEPS, 1), model, optimizer, path)
    saved = full_state(model, optimizer)
    alone, _ = build(1)
    assert load_checkpoint(path, alone) == STEPS
    assert_identical(alone.state_dict(), saved["model"])
    fresh, fresh_optimizer = build(1)
    assert load_checkpoint(path, fresh, fresh_optimizer) == STEPS
    assert_identical(full_state(fresh, fresh_optimizer), saved)
    assert_identical(read_any(path).model, saved["model"])
    state = read_any(path, whole=False)
    assert state.model == {} and state.shards == path and state.step == STEPS


def test_a_resume_says_when_the_processes_or_the_parallelism_change(tmp_path):
    (tmp_path / "step_1").mkdir()  # a sharded checkpoint's directory
    recorded = TrainingState(config=config(tmp_path).to_dict(), world_size=2)
    same = layout_change(tmp_path / "step_1", recorded, config(tmp_path), Distributed(0, 0, 2))
    assert same is None
    fewer = layout_change(tmp_path / "step_1", recorded, config(tmp_path), Distributed())
    assert fewer == (
        "the checkpoint was saved by 2 processes under parallel = 'fsdp'; resuming with 1 process under "
        "parallel = 'fsdp': its shards are gathered into this process, and new checkpoints are sharded directories"
    )
    # a DDP run's file (its config from before `parallel` existed), resumed by 4 processes under FSDP
    recorded = TrainingState(config={"training": {}}, world_size=2)
    switched = layout_change(tmp_path / "step_1.pt", recorded, config(tmp_path), Distributed(0, 0, 4))
    assert (
        switched is not None
        and "under parallel = 'ddp'; resuming with 4 processes under parallel = 'fsdp'" in switched
    )
    assert "each process takes its shards of it" in switched


@pytest.mark.slow
def test_a_run_of_two_processes_resumes_with_one_from_its_sharded_checkpoint(tmp_path, capsys):
    """The command users run: `torchrun --nproc_per_node 2 -m scratchlm train` under `training.parallel =
    "fsdp"` saves directories; one process resumes from the newest, says so, and ends where an uninterrupted
    run of one process does, to float32 rounding (the two processes summed halves of each batch)."""
    from test_trainer import small_config

    from scratchlm.training.trainer import train

    train(small_config(tmp_path, "straight"))
    two = small_config(tmp_path, "run", training={"parallel": "fsdp", "max_steps": 8})
    (tmp_path / "config.toml").write_text(two.to_toml())
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "scratchlm", "train", "--config", str(tmp_path / "config.toml"),
    ]  # fmt: skip
    result = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDirectory(tmp_path / "run")
    assert run.checkpoints() == [run.checkpoint(4, True), run.checkpoint(8, True)]
    capsys.readouterr()

    train(small_config(tmp_path, "run", training={"parallel": "fsdp"}), resume=True)
    printed = " ".join(capsys.readouterr().err.split())
    assert "saved by 2 processes under parallel = 'fsdp'; resuming with 1 process" in printed
    resumed = read_any(run.checkpoint(12, True))
    whole = Checkpoint.read(tmp_path / "straight" / "checkpoints" / "step_00000012.pt")
    assert resumed.training.world_size == 1
    for name, tensor in whole.model.items():
        torch.testing.assert_close(resumed.model[name], tensor, rtol=1e-4, atol=1e-4)
