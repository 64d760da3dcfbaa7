"""Sharded training (`training.parallel = "fsdp"`): two processes on CPU (Gloo) train like one process with the
same global batch, for the spec recipe (AdamW) and the fast one (Muon, whose matrices are gathered
to an owner process, orthogonalised and scattered back as shards); the activation-checkpointed model computes
what the plain one does; and Muon's owners are balanced by size.

Launched the way users launch it: `torchrun --nproc_per_node 2 -m scratchlm train --config FILE`.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_gradients, assert_same_state, last_checkpoint, run_metrics, torchrun_train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from scratchlm import train
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.checkpointing import apply_activation_checkpointing
from scratchlm.training.config import TrainConfig
from scratchlm.training.distributed import local
from scratchlm.training.grad import clip_grad_norm
from scratchlm.training.loss_scale import INIT_SCALE, LossScaler
from scratchlm.training.muon import assign_owners
from scratchlm.training.recipes import FAST, RECIPES, merged

STEPS = 30
SHAPE = {"vocab_size": 64, "context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 4}


def config(tmp_path: Path, recipe: dict, precision: str, learnable: bool = False) -> TrainConfig:
    """The run of `recipe` at `precision` on uniformly random tokens, or (`learnable`) on a repeating pattern
    with 10% noise, which a model learns: its loss falls far below the ln 64 of random tokens, so its
    gradients, not the data's entropy, decide it."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 4000).astype(np.uint16)
    if learnable:
        pattern = np.tile(np.arange(64, dtype=np.uint16), 63)[:4000]
        tokens = np.where(rng.random(4000) < 0.1, tokens, pattern)
    np.save(tmp_path / "train.npy", tokens)
    np.save(tmp_path / "valid.npy", tokens[:800])
    shape = {
        "data": {"train": str(tmp_path / "train.npy"), "valid": str(tmp_path / "valid.npy")},
        "model": SHAPE,
        # AdamW's eps at 1e-6: a weight whose gradient is nearly all rounding (an embedding row of a token the
        # batch barely uses) would otherwise be stepped by ±lr in a direction the rounding picks. Muon's
        # Newton–Schulz in float32, for the same reason (in bf16 it would amplify the reductions' rounding).
        "optimizer": {"lr": 1e-2, "eps": 1e-6, "muon_bf16": False, "grad_clip": 0.5},
        "schedule": {"warmup_iters": 3},
        # per process: 4 sequences as 2 micro-batches of 2
        "training": {
            "batch_size": 8,
            "grad_accum": 2,
            "max_steps": STEPS,
            "device": "cpu",
            "precision": precision,
            "parallel": "fsdp",
        },
        "eval": {"interval": 10, "iters": 2},
        "checkpoint": {"interval": 0},
        "logging": {"run_dir": str(tmp_path / "one"), "log_interval": 1},
    }
    return TrainConfig.from_dict(merged(shape, recipe))


def two_processes_against_one(tmp_path: Path, config: TrainConfig, *sets: str) -> tuple[dict, dict]:
    """Train `config` in this process (the whole global batch at once; `parallel` is ignored) and under
    torchrun in two processes; returns the two runs' final checkpoints."""
    config_path = tmp_path / "config.toml"
    config_path.write_text(config.to_toml())
    train(config.replace(training={"grad_accum": 1}))
    console = torchrun_train(config_path, tmp_path / "two", *sets)
    assert "on cpu × 2 processes (fsdp)" in console
    assert len(run_metrics(tmp_path / "two", "train_loss")) == STEPS  # rank 0 alone wrote the records
    return last_checkpoint(tmp_path / "one"), last_checkpoint(tmp_path / "two")


def assert_same_runs(tmp_path: Path, one: dict, two: dict, rtol: float, metrics: bool = True) -> None:
    """The runs "one" and "two" in `tmp_path` logged the same metrics (`metrics`) to `rtol`, and their final
    checkpoints `one` and `two` hold the same model and optimizer state to 10 × `rtol`."""
    for key in (
        ("train_loss", "grad_norm", "val_loss") if metrics else ()
    ):  # grad_norm: global, before clipping
        np.testing.assert_allclose(
            run_metrics(tmp_path / "two", key), run_metrics(tmp_path / "one", key), rtol=rtol, err_msg=key
        )
    # The sharded run's checkpoint, consolidated, is the one-process run's: the same names, the same values.
    assert one["model"].keys() == two["model"].keys()
    for key in one["model"]:
        torch.testing.assert_close(two["model"][key], one["model"][key], atol=10 * rtol, rtol=10 * rtol)
    assert one["optimizer"]["param_groups"] == two["optimizer"]["param_groups"]
    for index, state in one["optimizer"]["state"].items():
        for name, value in state.items():
            other = two["optimizer"]["state"][index][name]
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(other, value, atol=10 * rtol, rtol=10 * rtol)
            else:
                assert other == value


def test_fsdp_two_processes_match_one_with_adamw(tmp_path: Path):
    """fp32: the only differences are the order of the gradient sums (each process reduces its half of the
    batch, then the halves are averaged) and of the global norm's sum of squares: float32 roundings, 1e-7
    relative a step, which 30 steps of AdamW keep well within 1e-5."""
    one, two = two_processes_against_one(tmp_path, config(tmp_path, {}, "fp32"))
    assert_same_runs(tmp_path, one, two, rtol=1e-5)


def test_fsdp_two_processes_match_one_with_muon_and_activation_checkpointing(tmp_path: Path):
    """The fast recipe: Muon's update of each matrix is computed whole by its owner from the gathered shards,
    as one process computes it, so fp32 agrees to rounding as with AdamW. The two processes also recompute
    each block's activations in the backward pass, which changes no value."""
    fast = config(tmp_path, FAST, "fp32").replace(model={"value_embeddings": 1})
    one, two = two_processes_against_one(tmp_path, fast, "training.activation_checkpointing=true")
    assert_same_runs(tmp_path, one, two, rtol=1e-5)


@pytest.mark.slow  # about 75 s here
def test_a_sharded_run_resumes_sharded_or_in_one_process(tmp_path: Path):
    """The sharded run's checkpoint (a directory of each process's shards, `scratchlm.run.sharded`) resumes on
    two processes, and in one process, which reads every shard: both continue the run as if it had not
    stopped, to float32 rounding."""
    whole = config(tmp_path, FAST, "fp32").replace(
        training={"max_steps": 8},
        schedule={"cosine_cycle_iters": 8},  # the schedule of 8 steps, also in the session that stops at 4
        eval={"interval": 0},
    )
    config_path = tmp_path / "config.toml"
    config_path.write_text(whole.to_toml())
    train(whole.replace(training={"grad_accum": 1}))
    torchrun_train(config_path, tmp_path / "two", "training.max_steps=4")
    shutil.copytree(tmp_path / "two", tmp_path / "then-one")
    torchrun_train(config_path, tmp_path / "two", resume=True)
    train(whole.replace(logging={"run_dir": str(tmp_path / "then-one")}), resume=True)
    for run in ("two", "then-one"):
        np.testing.assert_allclose(
            run_metrics(tmp_path / run, "train_loss"), run_metrics(tmp_path / "one", "train_loss"), rtol=1e-5
        )
        final = last_checkpoint(tmp_path / run)
        assert final["iteration"] == 8
        assert_same_runs(tmp_path, last_checkpoint(tmp_path / "one"), final, rtol=1e-5, metrics=False)


@pytest.mark.slow  # six torchrun launches: about two minutes here
def test_a_sharded_resume_is_bit_exact_at_the_same_size_and_within_rounding_across_2_1_2(tmp_path: Path):
    """Stopped and resumed on the same two processes, a sharded run (the fast recipe: Muon's owners gather
    and scatter too) is the uninterrupted run to the bit: each process reads back exactly its shards. Moved
    to one process and back to two, the order of the float32 gradient sums changes, so it is the same run to
    float32 rounding."""
    whole = config(tmp_path, FAST, "fp32").replace(
        training={"max_steps": 9},
        schedule={"cosine_cycle_iters": 9},  # one schedule for every session, also those that stop early
        eval={"interval": 0},
    )
    config_path = tmp_path / "config.toml"
    config_path.write_text(whole.to_toml())
    torchrun_train(config_path, tmp_path / "straight")
    torchrun_train(config_path, tmp_path / "resumed", "training.max_steps=4")
    torchrun_train(config_path, tmp_path / "resumed", resume=True)
    straight, resumed = last_checkpoint(tmp_path / "straight"), last_checkpoint(tmp_path / "resumed")
    assert resumed["iteration"] == 9
    assert run_metrics(tmp_path / "resumed", "train_loss") == run_metrics(tmp_path / "straight", "train_loss")
    assert_same_state(straight, resumed)

    torchrun_train(config_path, tmp_path / "moved", "training.max_steps=3")
    train(whole.replace(training={"max_steps": 6}, logging={"run_dir": str(tmp_path / "moved")}), resume=True)
    console = torchrun_train(config_path, tmp_path / "moved", resume=True)
    assert "saved by 1 process" in console  # the resume says what it does
    np.testing.assert_allclose(
        run_metrics(tmp_path / "moved", "train_loss"),
        run_metrics(tmp_path / "straight", "train_loss"),
        rtol=1e-5,
    )
    assert_same_runs(tmp_path, straight, last_checkpoint(tmp_path / "moved"), rtol=1e-5, metrics=False)


@pytest.mark.slow  # compiling takes about a minute and a half here
def test_fsdp_compiles_each_block(tmp_path: Path):
    """Each block compiled on its own, then sharded, with activation checkpointing inside: the compiled code
    fuses and reorders float32 operations (a rounding of 1e-7 relative here and there), so the losses agree
    with one uncompiled process to 1e-4 rather than 1e-5 over these few steps."""
    short = config(tmp_path, {}, "fp32").replace(training={"max_steps": 6}, eval={"interval": 3})
    config_path = tmp_path / "config.toml"
    config_path.write_text(short.to_toml())
    train(short.replace(training={"grad_accum": 1}))
    sets = ("training.compile=true", "training.activation_checkpointing=true")
    assert ", compiled (" in torchrun_train(config_path, tmp_path / "two", *sets)
    for key in ("train_loss", "val_loss"):
        np.testing.assert_allclose(
            run_metrics(tmp_path / "two", key), run_metrics(tmp_path / "one", key), rtol=1e-4, err_msg=key
        )


# Under bf16 or fp16 each block's parameters are gathered in that dtype (the plan's compute dtype) and its
# gradients reduced in float32. One process runs the same matmuls in the low precision under autocast, from
# float32 weights cast at each use: the same low-precision values. What differs is the gains of the blocks'
# RMSNorms, held in the low precision for the product (one process multiplies by the float32 gain): the
# norm's output moves by at most one rounding of the format, and, rounded again by the matmul that reads it,
# an element now and then lands on the neighbouring representable value: a change of one unit roundoff of the
# format (half its machine epsilon: 2^-8 for bf16's 8-bit significand, 2^-11 for fp16's 11) in that element,
# and of a small fraction of it in the loss, a mean over thousands of them, and in the gradient norm, a root
# of a sum of thousands of squares. As in DDP (tests/test_ddp.py), one unit bounds what 30 steps of such flips
# compound to in those, and ten in the saved weights and moments, single elements (`assert_same_runs`). fp16
# also runs the loss scaler on the shards.
TOLERANCE = {
    name: torch.finfo(dtype).eps / 2 for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
}


@pytest.mark.slow  # about 40 s each here
@pytest.mark.parametrize("precision", TOLERANCE)
def test_fsdp_two_processes_match_one_in_low_precision(tmp_path: Path, precision: str):
    """On data the model learns, so that the losses say something of the gradients, the two runs agree in
    their losses, gradient norms and final weights and optimizer state."""
    one, two = two_processes_against_one(tmp_path, config(tmp_path, {}, precision, learnable=True))
    assert run_metrics(tmp_path / "one", "train_loss")[-1] < 0.5 * math.log(64)  # it learned the pattern
    assert_same_runs(tmp_path, one, two, rtol=TOLERANCE[precision])


def test_one_process_ignores_fsdp_and_says_so_once(tmp_path: Path, capfd):
    single = config(tmp_path, {}, "fp32").replace(training={"max_steps": 2}, eval={"iters": 0})
    train(single)
    assert capfd.readouterr().err.count('training.parallel = "fsdp" in one process: ignored') == 1
    assert len(run_metrics(tmp_path / "one", "train_loss")) == 2


def _clip_on_shards(rank: int, world: int, store: str) -> None:
    """In each of `world` processes: the global norm of sharded gradients, then an overflow on rank 1 alone."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        whole = [torch.randn(5, 3), torch.randn(4), torch.randn(1, 2)]  # 1 row: rank 1's shard is empty
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in whole]
        for p, t in zip(params, whole, strict=True):
            p.grad = distribute_tensor(2 * t, mesh, [Shard(0)])
        norm = clip_grad_norm(params, max_l2_norm=1.0)
        expected = torch.linalg.vector_norm(torch.cat([2 * t.flatten() for t in whole]))
        torch.testing.assert_close(norm, expected)
        for p, t in zip(params, whole, strict=True):  # every shard scaled by the same factor
            torch.testing.assert_close(p.grad.full_tensor(), 2 * t / (expected + 1e-6))

        scaler = LossScaler(enabled=True)
        if rank == 1:
            local(params[0].grad)[0, 0] = math.inf
        assert not scaler.update(clip_grad_norm(params, max_l2_norm=1.0))  # skipped on every rank
        assert scaler.scale == INIT_SCALE / 2 and scaler.skipped == 1
    finally:
        dist.destroy_process_group()


def test_sharded_gradients_are_clipped_by_the_global_norm_and_an_overflow_skips_every_rank(tmp_path: Path):
    torch.multiprocessing.spawn(_clip_on_shards, args=(2, str(tmp_path / "store")), nprocs=2)


def _resume_where_each_sees(rank: int, store: str, run_dirs: list[str]) -> None:
    """One process of two, each with its own run directory, starting a resume (`restore`)."""
    from scratchlm.run.directory import RunDirectory
    from scratchlm.training.distributed import Distributed
    from scratchlm.training.start import restore

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = TrainConfig.load(Path(run_dirs[rank]).parent / "config.toml")
        with pytest.raises(ScratchlmError, match=r"different newest checkpoints .*\(none to step 3\)"):
            restore(cfg, RunDirectory(run_dirs[rank]), None, None, torch.device("cpu"),
                    Distributed(rank, rank, 2), resume=True)  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_processes_that_find_different_checkpoints_refuse_to_resume(tmp_path: Path):
    """Two machines without a shared file system: one finds step 3, the other no checkpoint. Both stop with
    the same one-line error, before any other collective (none of them hangs)."""
    whole = config(tmp_path, RECIPES["spec"], "fp32")
    (tmp_path / "config.toml").write_text(whole.to_toml())
    seen, empty = tmp_path / "seen", tmp_path / "empty"
    (seen / "checkpoints").mkdir(parents=True)
    (seen / "checkpoints" / "step_00000003.pt").write_bytes(b"")  # only its name is read before the check
    empty.mkdir()
    torch.multiprocessing.spawn(
        _resume_where_each_sees, args=(str(tmp_path / "store"), [str(seen), str(empty)]), nprocs=2
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("parallel", "zero", "training.parallel must be one of 'ddp', 'fsdp', got 'zero'"),
        ("reshard_after_forward", 1, "training.reshard_after_forward must be true or false, got 1"),
        ("activation_checkpointing", "yes", "training.activation_checkpointing must be true or false"),
    ],
)
def test_the_parallel_keys_are_checked_with_one_line(tmp_path: Path, key: str, value, message: str):
    values = config(tmp_path, {}, "fp32").to_dict()
    values["training"][key] = value
    with pytest.raises(ScratchlmError, match=re.escape(message)) as raised:
        TrainConfig.from_dict(values)
    assert "\n" not in str(raised.value)


def test_activation_checkpointing_computes_the_same_loss_and_gradients():
    torch.manual_seed(0)
    plain = TransformerLM(ModelConfig(**SHAPE, value_embeddings=1))
    checkpointed = TransformerLM(plain.config)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed)
    ids = torch.randint(0, 64, (3, 17))
    losses = []
    for model in (plain, checkpointed):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    assert_same_gradients(checkpointed, plain, atol=0, rtol=0)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()


def test_activation_checkpointing_keeps_only_each_blocks_input():
    """What the backward pass keeps: with checkpointing, the autograd graph holds no tensor saved inside a
    block, only what is saved outside them (the blocks' inputs among them)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**SHAPE, "num_layers": 4}))
    ids = torch.randint(0, 64, (2, 16))

    def saved_bytes() -> int:
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids).sum().backward()
        return total

    plain = saved_bytes()
    apply_activation_checkpointing(model)
    assert saved_bytes() < plain / 2


@pytest.mark.parametrize(
    ("sizes", "world", "owners"),
    [
        # largest first, each to the least loaded rank: 5 -> 0, 4 -> 1, 3 -> 1 (4 < 5), 3 -> 0, 3 -> 1
        ([3, 5, 3, 4, 3], 2, [1, 0, 0, 1, 1]),
        # a Transformer's: 4 square matrices and 3 of 4x their size a block, 2 blocks, 4 ranks: the large
        # ones go round the ranks, then the small ones fill the two ranks that have one large one fewer;
        # every rank ends with 8
        ([1, 1, 1, 1, 4, 4, 4] * 2, 4, [2, 3, 2, 3, 0, 1, 2, 2, 3, 2, 3, 3, 0, 1]),
        ([7], 3, [0]),
    ],
)
def test_muon_owners_are_assigned_largest_first_to_the_least_loaded_rank(sizes, world, owners):
    assert assign_owners(sizes, world) == owners


def test_muon_owners_are_balanced_within_four_thirds_of_the_best_split():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = [int(s) for s in rng.integers(1, 100, rng.integers(1, 9))]
        world = int(rng.integers(2, 4))
        owners = assign_owners(sizes, world)
        busiest = max(sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(world))
        best = min(  # every assignment, tried: the smallest possible busiest load
            max(sum(s for s, o in zip(sizes, split, strict=True) if o == r) for r in range(world))
            for split in itertools.product(range(world), repeat=len(sizes))
        )
        assert busiest <= 4 / 3 * best
