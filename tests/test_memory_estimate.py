"""The training-memory estimate per process (`scratchlm.model.memory`, `scratchlm doctor --world N`): against
values computed by hand for a small model, against the bytes of a real model's, gradients' and optimizer's
tensors after a step (a LoRA-adapted one too), and the doctor's verdict against mocked CPU and GPU memories
and its LoRA comparison against the bytes of the base it fine-tunes."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from serve_helpers import chat_run

from scratchlm import ModelConfig, TransformerLM
from scratchlm.cli import doctor, main
from scratchlm.device.host import available_ram_bytes
from scratchlm.device.profile import DeviceProfile
from scratchlm.model import memory
from scratchlm.model.config import LoRAConfig, default_lora_targets
from scratchlm.model.lora import Adapters, apply_lora
from scratchlm.model.loss import cross_entropy
from scratchlm.model.memory import HEADROOM, MemoryBudget, lora_memory, rank_memory, suggest
from scratchlm.run.load import load_trained
from scratchlm.training.config import TrainConfig
from scratchlm.training.optimizers import OptimizerConfig, build_optimizer
from tests.test_trainer import small_config

# vocab 64, context 16, d_model 32, 2 blocks of 4 heads, SwiGLU d_ff 96, untied head, pre-norm.
SMALL = ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=96)
# Parameters by hand: a block is attention 4·32² = 4,096 + SwiGLU 3·32·96 = 9,216 + two gains 2·32 = 64,
# i.e. 13,376; the root is the embeddings 64·32 = 2,048 + the head 2,048 + the final gain 32 = 4,128.
BLOCK, ROOT = 13_376, 4_128
TOTAL = 2 * BLOCK + ROOT  # 30,880
MATRICES = 2 * (4_096 + 9_216)  # 26,624: Muon's
# Activations of one sequence of 16 tokens (the CS336 assignment-1 handout's list,
# `accounting.activation_elements`): per block
# 2 norms 2·16·32 = 1,024, Q K V 16·96 = 1,536, scores and softmax 2·4·16² = 2,048, weighted sum and output
# projection 2·16·32 = 1,024, SwiGLU 4·16·96 + 16·32 = 6,656: 12,288 a block; then the final norm 16·32 = 512
# and logits + probabilities 2·16·64 = 2,048.
BLOCK_ACTS, HEAD_ACTS = 12_288, 512 + 2_048


def estimate(
    parallel="ddp", world=1, checkpointing=False, optimizer="adamw", precision="fp32", batch=8, accum=2
):
    return rank_memory(SMALL, optimizer, precision, batch, accum, world, parallel, checkpointing)


def test_one_process_by_hand():
    one = estimate()
    assert (one.parameters, one.gradients, one.optimizer_state, one.buffers) == (
        4 * TOTAL,
        4 * TOTAL,
        8 * TOTAL,
        0,
    )
    sequences = 8 // 2  # the batch of 8 in 2 micro-batches
    assert one.activations == 4 * sequences * (2 * BLOCK_ACTS + HEAD_ACTS) == 434_176
    # Checkpointed: every block's float32 input (4 sequences × 16 tokens × 32), one block, the head.
    ckpt = estimate(checkpointing=True)
    assert ckpt.activations == 2 * 4 * 16 * 32 * 4 + 4 * sequences * (BLOCK_ACTS + HEAD_ACTS) == 253_952
    assert ckpt.state == one.state and ckpt.total == one.total - (434_176 - 253_952)
    # bf16 halves the activations, not the float32 master weights, gradients and moments.
    bf16 = estimate(precision="bf16")
    assert bf16.state == one.state and bf16.activations == one.activations // 2
    assert estimate(optimizer="muon").optimizer_state == 4 * (MATRICES + 2 * (TOTAL - MATRICES)) == 140_544
    assert estimate(optimizer="sgd").optimizer_state == 0
    assert estimate(parallel="fsdp").total == one.total  # a world of one shards nothing
    assert one.layout == "1 process" and estimate(world=2, parallel="fsdp", checkpointing=True).layout == (
        "2 processes, fsdp, activation checkpointing"
    )


def test_two_processes_by_hand():
    ddp, fsdp = estimate(world=2), estimate(parallel="fsdp", world=2)
    # the gradients are views into DDP's buckets (gradient_as_bucket_view): no second copy of them
    assert ddp.state == 16 * TOTAL and ddp.buffers == 0 and ddp.total == 16 * TOTAL + ddp.activations
    assert ddp.activations == 434_176 // 2  # 2 sequences a micro-batch
    assert (fsdp.parameters, fsdp.optimizer_state) == (4 * TOTAL // 2, 8 * TOTAL // 2)
    # the gathered root and one block, weights and gradients, in float32
    assert fsdp.buffers == (ROOT + BLOCK) * (4 + 4) == 140_032
    assert estimate(parallel="fsdp", world=2, precision="bf16").buffers == (ROOT + BLOCK) * (2 + 2)
    assert rank_memory(SMALL, "adamw", "fp32", 9, 1, 3, "fsdp", False).parameters == 4 * math.ceil(TOTAL / 3)


def test_a_batch_that_does_not_divide_and_an_unknown_optimizer_are_one_line_errors():
    with pytest.raises(
        Exception, match=r"batch_size \(8\) must be divisible by processes × grad_accum \(3 × 2\)"
    ):
        estimate(world=3)
    with pytest.raises(Exception, match="no memory estimate for optimizer 'lion'"):
        estimate(optimizer="lion")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


FAST = TrainConfig.load(Path(__file__).parents[1] / "configs" / "tinystories-fast.toml")
MEASURED = {
    "adamw": (SMALL, OptimizerConfig()),
    "sgd": (SMALL, OptimizerConfig(name="sgd")),
    # the fast recipe's model, small: Muon, value embeddings, QK-norm, ReLU², soft-capping
    "muon": (
        dataclasses.replace(FAST.model, vocab_size=64, context_length=16, d_model=32, num_heads=4, d_ff=128),
        FAST.optimizer,
    ),
    "tied": (dataclasses.replace(SMALL, tie_embeddings=True), OptimizerConfig()),
}


def real_step(model, config, optimizer_config, precision):
    """One training step of `model` with the project's optimizer (under bf16 autocast for bf16); returns the
    optimizer."""
    optimizer = build_optimizer(optimizer_config, model, precision)
    tokens = torch.randint(0, config.vocab_size, (2, config.context_length + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    optimizer.step()
    return optimizer


def state_bytes(optimizer) -> int:
    return tensor_bytes(value for state in optimizer.state.values() for value in state.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", MEASURED)
def test_state_bytes_equal_the_tensors_of_a_real_step(case, precision):
    """One training step of the real model with the project's optimizer (under bf16 autocast too): the bytes
    of its parameters, gradients and optimizer state are exactly the estimate's."""
    config, optimizer_config = MEASURED[case]
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    optimizer = real_step(model, config, optimizer_config, precision)
    params = list(model.parameters())
    assert state_bytes(optimizer) > 0 or optimizer_config.name == "sgd"
    est = rank_memory(config, optimizer_config.name, precision, 2, 1, 1, "ddp", False)
    assert tensor_bytes(params) == est.parameters
    assert tensor_bytes(p.grad for p in params) == est.gradients
    assert state_bytes(optimizer) == est.optimizer_state


@pytest.mark.parametrize(
    ("targets", "tables"),
    [
        (LoRAConfig().targets, ()),
        (("q_proj", "v_proj", "w2"), ()),
        ((*LoRAConfig().targets, "lm_head"), ("token_embeddings", "value_embeddings")),
    ],
)
@pytest.mark.parametrize(("precision", "stored"), [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
@pytest.mark.parametrize("case", ["adamw", "sgd", "muon"])
def test_lora_state_bytes_equal_the_tensors_of_a_real_adapted_step(case, precision, stored, targets, tables):
    """A model adapted as a LoRA run adapts it (its frozen matrices stored as `lora.base_dtype` says, a bf16
    base on a float32 plan too; an adapter on the head and tables trained whole too) and one step: the bytes
    of every parameter, frozen and trained, of the trained ones' gradients and of the optimizer's state are
    exactly the estimate's; the frozen ones have no gradient."""
    config, optimizer_config = MEASURED[case]
    # the fast recipe's ReLU² feed-forward has no gate w3 to adapt; only the fast recipe has value embeddings
    adapted = tuple(t for t in targets if t != "w3" or config.ffn == "swiglu")
    train = tuple(t for t in tables if t != "value_embeddings" or config.value_embeddings)
    lora = LoRAConfig(rank=4, targets=adapted, base_dtype=stored, train=train)
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    apply_lora(model, Adapters(lora), base_dtype={"fp32": None, "bf16": torch.bfloat16}[stored])
    optimizer = real_step(model, config, optimizer_config, precision)
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trained and all(p.grad is None for p in frozen)
    vectors = [p for p in frozen if p.dim() == 1]  # the gains: float32 whatever the storage
    assert all(p.dtype == torch.float32 for p in vectors)
    bits = {"fp32": torch.float32, "bf16": torch.bfloat16}[stored]
    assert all(p.dtype == bits for p in frozen if p.dim() == 2)
    assert all(p.dtype == torch.float32 for p in trained)
    est = lora_memory(config, lora, optimizer_config.name, precision, 2, 1, 1, False)
    assert tensor_bytes(trained) + tensor_bytes(frozen) == est.parameters
    assert tensor_bytes(p.grad for p in trained) == est.gradients == 4 * sum(p.numel() for p in trained)
    assert state_bytes(optimizer) == est.optimizer_state


def test_lora_by_hand():
    """SMALL (d_model 32, d_ff 96, four heads of keys and values), rank 4 on all seven matrices: a block's
    adapters are 4 × (q 64 + k 64 + v 64 + output 64 + w1 128 + w2 128 + w3 128) = 2,560 values."""
    adapters = 2 * 2_560
    lora = lora_memory(SMALL, LoRAConfig(rank=4, base_dtype="bf16"), "adamw", "bf16", 8, 2, 1, False)
    full = estimate(precision="bf16")
    # frozen: every matrix and table in 2 bytes (the base in bf16), the gains 2 · 64 + 32 = 160 in 4
    gains = 160
    assert lora.parameters == 2 * (TOTAL - gains) + 4 * gains + 4 * adapters
    for precision in ("fp32", "bf16"):  # a float32 base is 4 bytes a parameter on either plan
        kept = lora_memory(SMALL, LoRAConfig(rank=4, base_dtype="fp32"), "adamw", precision, 8, 2, 1, False)
        assert kept.parameters == 4 * TOTAL + 4 * adapters
    assert (lora.gradients, lora.optimizer_state, lora.buffers) == (4 * adapters, 8 * adapters, 0)
    # x Aᵀ: 7 matrices × 2 blocks × 4 sequences of 16 tokens × rank 4, in bf16; one block under checkpointing
    assert lora.activations == full.activations + 7 * 2 * 64 * 4 * 2
    ckpt = lora_memory(SMALL, LoRAConfig(rank=4, base_dtype="bf16"), "adamw", "bf16", 8, 2, 1, True)
    assert ckpt.activations == estimate(precision="bf16", checkpointing=True).activations + 7 * 64 * 4 * 2
    with pytest.raises(Exception, match="lora.targets: the blocks have no matrix 'qkv'"):
        lora_memory(SMALL, LoRAConfig(rank=4, targets=("qkv",)), "adamw", "bf16", 8, 2, 1, False)


def test_fsdp_shards_the_state_and_ddp_does_not():
    for world in (2, 4, 8):
        ddp, fsdp = estimate(world=world, batch=8 * world), estimate("fsdp", world=world, batch=8 * world)
        assert fsdp.state <= ddp.state / world + 12  # ceil(TOTAL / world) floats
        assert ddp.state == estimate(batch=8 * world).state


def test_fits_on_a_gpu_is_per_process_and_on_a_cpu_the_worlds():
    four = estimate("fsdp", world=4, batch=16)
    own = MemoryBudget(math.ceil(four.total / HEADROOM), "GPU memory of a mock GPU", shared=False)
    shared = dataclasses.replace(own, shared=True)
    assert own.fits(four) and not shared.fits(four)
    assert MemoryBudget(math.ceil(4 * four.total / HEADROOM), "available RAM", shared=True).fits(four)


def test_the_suggestion_prefers_ddp_then_fsdp_then_checkpointing_then_more_processes():
    """A batch of 64 in one micro-batch: the activations outweigh the state, so checkpointing saves more than
    sharding and every layout has a budget at which it is the first that fits."""
    at = {
        (world, parallel, ckpt): estimate(parallel, world, ckpt, batch=64, accum=1)
        for world in (2, 4)
        for parallel in ("ddp", "fsdp")
        for ckpt in (False, True)
    }
    order = [(2, "fsdp", True), (2, "ddp", True), (2, "fsdp", False), (2, "ddp", False)]
    assert [at[key].total for key in order] == sorted(at[key].total for key in order)

    def suggested(size: int):
        budget = MemoryBudget(math.ceil(size / HEADROOM), "GPU memory of a mock GPU", shared=False)
        chosen = suggest(SMALL, "adamw", "fp32", 64, 1, 2, budget).estimate
        return chosen and (chosen.world, chosen.parallel, chosen.checkpointing)

    for key in order:
        assert suggested(at[key].total) == key
    # below all of them at 2 processes: 4, the next world the batch divides among
    assert at[(4, "fsdp", True)].total < at[(2, "fsdp", True)].total
    assert suggested(at[(4, "fsdp", True)].total) == (4, "fsdp", True)
    assert suggested(1000) is None  # not even at 64 processes


def test_the_budget_is_the_gpus_own_memory_or_the_available_ram(tmp_path, monkeypatch):
    gpu = DeviceProfile(type="cuda", name="Mock GPU", gpu_memory_gib=24.0)
    assert doctor.memory_budget(gpu) == MemoryBudget(24 * 2**30, "GPU memory of Mock GPU", shared=False)
    assert doctor.memory_budget(dataclasses.replace(gpu, gpu_memory_gib=None)) is None
    monkeypatch.setattr("scratchlm.device.host.available_ram_bytes", lambda: 5 * 2**30)
    assert doctor.memory_budget(DeviceProfile(type="cpu", name="Mock CPU")) == MemoryBudget(
        5 * 2**30, "available RAM", shared=True
    )
    (tmp_path / "meminfo").write_text("MemTotal:  16000000 kB\nMemAvailable:    2000000 kB\n")
    assert available_ram_bytes(tmp_path, tmp_path) == 2_000_000 * 1024
    (tmp_path / "memory.max").write_text("1073741824\n")  # a container limited to 1 GiB, 0.25 GiB used
    (tmp_path / "memory.current").write_text(f"{2**28}\n")
    assert available_ram_bytes(tmp_path, tmp_path) == 2**30 - 2**28


@pytest.fixture
def cpu_profile(monkeypatch):
    fixture = Path(__file__).parent / "fixtures" / "device" / "cpu-no-native-bf16.json"
    monkeypatch.setenv("SCRATCHLM_DEVICE_PROFILE", str(fixture))


def test_doctor_world_prints_the_estimates_and_suggests_a_layout(tmp_path, cpu_profile, monkeypatch, capsys):
    config = small_config(tmp_path, model=dataclasses.asdict(SMALL), training={"grad_accum": 2})
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    args = ["doctor", "--json", "--no-compile-check", "--config", str(path), "--world", "2"]
    fsdp_ckpt = estimate("fsdp", world=2, checkpointing=True)
    # RAM for the two processes of fsdp with checkpointing, and not for ddp with it
    ram = math.ceil(2 * fsdp_ckpt.total / HEADROOM)
    monkeypatch.setattr("scratchlm.device.host.available_ram_bytes", lambda: ram)
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)["memory"]
    rows = {(row["parallel"], row["checkpointing"]): row for row in report["estimates"]}
    assert rows[("fsdp", True)]["total"] == fsdp_ckpt.total and rows[("fsdp", True)]["fits"]
    assert [row["fits"] for row in report["estimates"]] == [False, False, False, True]
    assert report["suggestion"]["layout"] == "2 processes, fsdp, activation checkpointing"
    assert report["budget"] == {"bytes": ram, "what": "available RAM", "shared": True}

    table = [arg for arg in args if arg != "--json"]
    assert main(table) == 0
    out = capsys.readouterr().out
    assert "Training memory at 2 process(es), fp32" in out
    assert "suggestion: 2 processes, fsdp, activation checkpointing" in out

    monkeypatch.setattr("scratchlm.device.host.available_ram_bytes", lambda: 1000)
    assert main(table) == 0
    assert "suggestion: nothing fits, even at 4 processes" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--world", "0"], "--world must be at least 1, got 0"),
        (["--world", "3"], "training.batch_size (8) must be divisible by processes × grad_accum (3 × 1)"),
        (["--world", "2", "--no-config"], "--world estimates a config's training memory: give --config FILE"),
    ],
)
def test_doctor_world_refuses_bad_input_in_one_line(tmp_path, cpu_profile, capsys, extra, message):
    path = tmp_path / "config.toml"
    path.write_text(small_config(tmp_path).to_toml())
    config = [] if "--no-config" in extra else ["--config", str(path)]
    assert main(["doctor", "--no-compile-check", *config, *[a for a in extra if a != "--no-config"]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_module_names_the_layouts_it_compares():
    assert list(memory.layouts(1)) == [("ddp", False), ("ddp", True)]
    assert list(memory.layouts(2)) == list(memory.PREFERENCE)


def test_doctor_compares_a_lora_sft_config_with_full_fine_tuning_of_its_base(tmp_path, cpu_profile, capsys):
    """A LoRA sft config has no [model]: the doctor's estimates are of its base's model, whose real parameter
    bytes are full fine-tuning's parameters term and, adapted, LoRA's."""
    base = chat_run(tmp_path / "base", context=32, seed=0)
    path = tmp_path / "sft.toml"
    path.write_text(
        f'[sft]\nbase = "{base}"\ntrain = "chats.jsonl"\n[lora]\nrank = 4\nbase_dtype = "bf16"\n'
        "[training]\nmax_steps = 10\n"
    )
    args = ["doctor", "--no-compile-check", "--config", str(path)]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["lora"]
    assert report["precision"] == "fp32" and report["layout"] == "1 process"
    model = load_trained(str(base), "cpu").model
    assert report["full"]["parameters"] == tensor_bytes(model.parameters())
    # the targets sft gives a base when the config names none: its blocks' matrices and its untied head
    targets = default_lora_targets(model.config)
    assert "lm_head" in targets
    apply_lora(model, Adapters(LoRAConfig(rank=4, targets=targets)), base_dtype=torch.bfloat16)
    assert report["lora"]["parameters"] == tensor_bytes(model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert report["lora"]["gradients"] == 4 * trained and report["lora"]["optimizer_state"] == 8 * trained
    full, lora = report["full"]["total"], report["lora"]["total"]
    assert lora < full and report["ratio"] == lora / full

    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "LoRA against full fine-tuning: training memory at 1 process, fp32" in out
    assert "full fine-tuning" in out and "LoRA rank 4 " in out and f"{lora / full:.2f}×" in out
    assert f"{lora:,} bytes against full fine-tuning's {full:,} ({lora / full:.2f}×)" in out
