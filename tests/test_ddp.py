"""Two processes with DistributedDataParallel (gloo, CPU) train like one process with the same global batch, at
every precision: exactly (to float32 rounding) in fp32, to within the low precision's rounding in bf16 and fp16.

Launched the way users launch it: `torchrun --nproc_per_node 2 -m scratchlm train --config FILE`.
"""

import socket
import subprocess
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TORCHRUN_ENV, run_metrics, torchrun_command, torchrun_train

from scratchlm import train
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel import PARALLELISMS
from scratchlm.parallel.ddp import parallelize_ddp
from scratchlm.parallel.execution import ParallelSettings
from scratchlm.parallelisms import ParallelName
from scratchlm.training.config import TrainConfig

# How far two processes may drift from one. In fp32 the only difference is the order of the gradient sums
# (the all-reduce adds two halves of the batch), a few float32 roundings: 1e-5 relative. Under bf16 or fp16
# autocast a matmul over half the batch may round an output element to the neighbouring low-precision value
# where the float32 accumulations differ in their last bits; such a flip moves that element by one unit of the
# format's precision (2^-8 for bf16's 8-bit significand, 2^-11 for fp16's 11) and the loss, a mean over
# thousands of such elements, by a small fraction of it. Six steps compound it: the bound is one unit, which
# no rounding noise reaches (measured: 1.6e-4 in bf16, against 3.9e-3 allowed).
TOLERANCE = {"fp32": 1e-5, "bf16": 2.0**-8, "fp16": 2.0**-11}


def ddp_config(tmp_path: Path, precision: str = "fp32") -> Path:
    """A tiny run (random tokens, 6 steps of a global batch of 8) written as `tmp_path/config.toml`, whose
    path it returns; each process takes 4 sequences as 2 micro-batches of 2 when two share it."""
    tokens = np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16)
    np.save(tmp_path / "train.npy", tokens)
    np.save(tmp_path / "valid.npy", tokens[:800])
    config = TrainConfig.from_dict(
        {
            "data": {"train": str(tmp_path / "train.npy"), "valid": str(tmp_path / "valid.npy")},
            "model": {"vocab_size": 64, "context_length": 16, "d_model": 32, "num_layers": 2, "num_heads": 4},
            # AdamW's eps at 1e-6: a weight whose gradient is nearly all rounding (an embedding row of a token the
            # batch barely uses) would otherwise be stepped by ±lr in a direction the rounding picks.
            "optimizer": {"lr": 1e-2, "eps": 1e-6},
            "schedule": {"warmup_iters": 2},
            "training": {
                "batch_size": 8,
                "grad_accum": 2,
                "max_steps": 6,
                "device": "cpu",
                "precision": precision,
            },
            "eval": {"interval": 3, "iters": 3},
            "checkpoint": {"interval": 0},
            "logging": {"run_dir": str(tmp_path / "one"), "log_interval": 1},
        }
    )
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    return path


@pytest.mark.parametrize("precision", TOLERANCE)
def test_two_processes_match_one(tmp_path: Path, precision: str):
    rtol = TOLERANCE[precision]
    config_path = ddp_config(tmp_path, precision)
    config = TrainConfig.load(config_path)
    train(config.replace(training={"grad_accum": 1}))  # the whole global batch at once, in this process
    torchrun_train(config_path, tmp_path / "two")

    one, two = tmp_path / "one", tmp_path / "two"
    np.testing.assert_allclose(run_metrics(two, "train_loss"), run_metrics(one, "train_loss"), rtol=rtol)
    np.testing.assert_allclose(run_metrics(two, "grad_norm"), run_metrics(one, "grad_norm"), rtol=10 * rtol)
    np.testing.assert_allclose(run_metrics(two, "val_loss"), run_metrics(one, "val_loss"), rtol=rtol)
    assert len(run_metrics(two, "train_loss")) == 6  # rank 0 alone wrote the records
    one = torch.load(tmp_path / "one" / "checkpoints" / "step_00000006.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoints" / "step_00000006.pt", weights_only=True)
    assert one["model"].keys() == two["model"].keys()  # the spec's names, no "module." prefix
    for key in one["model"]:
        torch.testing.assert_close(two["model"][key], one["model"][key], atol=10 * rtol, rtol=10 * rtol)
    assert not (two["model"]["lm_head.weight"] == 0).all()


def test_the_config_accepts_exactly_the_kinds_of_parallelism():
    assert set(typing.get_args(ParallelName)) == set(PARALLELISMS)


def test_ddp_keeps_no_second_copy_of_the_gradients(tmp_path: Path):
    """The gradients are views into DDP's flat all-reduce buckets (`gradient_as_bucket_view`): after a backward
    pass the parameters' gradients share a bucket's storage, where gradients of their own would each have
    theirs, a second copy of every gradient beside the buckets."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        model = TransformerLM(
            ModelConfig(
                vocab_size=64, context_length=8, d_model=32, num_layers=2, num_heads=4, tie_embeddings=False
            )
        )
        execution = parallelize_ddp(model, torch.device("cpu"), ParallelSettings(world_size=1))
        for _ in range(2):  # the second backward pass too: the views last past the first step's gradients
            model.zero_grad(set_to_none=True)
            execution.train_model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
        grads = [p.grad for p in model.parameters()]
        assert len(grads) > 10 and all(g is not None for g in grads)
        buckets = {g.untyped_storage().data_ptr() for g in grads}
        assert len(buckets) <= 2  # DDP's small first bucket, then one of 25 MB
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_machines_train_one_run_like_one_machine(tmp_path: Path):
    """Two torchrun "machines" on this host (one process each, meeting at a c10d rendezvous on 127.0.0.1), as
    `docs/distributed.md` launches several machines, train the same run as one machine with two processes,
    to the bit. Each machine is given its own run directory, as machines without a shared disk would have:
    the process of RANK 1 (the c10d rendezvous decides which machine that is) has LOCAL_RANK 0 too, and
    writes nothing."""
    config = ddp_config(tmp_path)
    port = free_port()
    nodes = [
        subprocess.Popen(
            torchrun_command(
                config, tmp_path / f"node{rank}", processes=1,
                launcher=("--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-machines"),
            ),
            env=TORCHRUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    torchrun_train(config, tmp_path / "one-machine")

    [written] = [tmp_path / name for name in ("node0", "node1") if (tmp_path / name).exists()]
    for key in ("train_loss", "grad_norm", "val_loss"):
        assert run_metrics(written, key) == run_metrics(tmp_path / "one-machine", key)
    assert len(run_metrics(written, "train_loss")) == 6
