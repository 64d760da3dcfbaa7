"""save_checkpoint / load_checkpoint / RunDirectory's checkpoints / load_trained."""

import argparse
import io
from pathlib import Path

import pytest
import torch

from scratchlm import AdamW, cross_entropy, load_checkpoint, load_trained, save_checkpoint
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run import Checkpoint, RunDirectory
from scratchlm.run.checkpoint import read_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
CONFIG = ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=2, num_heads=2)
SPEC_KEYS = {
    "token_embeddings.weight",
    "ln_final.weight",
    "lm_head.weight",
    *(
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in [
            "ln1",
            "ln2",
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.output_proj",
            "ffn.w1",
            "ffn.w2",
            "ffn.w3",
        ]
    ),
}


def model_and_optimizer(seed: int = 0) -> tuple[TransformerLM, AdamW]:
    torch.manual_seed(seed)
    model = TransformerLM.from_config(CONFIG)
    return model, AdamW(model.parameters(), lr=1e-2)


def train_steps(model: TransformerLM, optimizer: AdamW, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 9), generator=g)
        optimizer.zero_grad()
        cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()
        optimizer.step()


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("target", ["path", "file"])
def test_round_trip_continues_exactly(tmp_path, target):
    model, optimizer = model_and_optimizer()
    train_steps(model, optimizer, 3, seed=1)
    out = tmp_path / "ckpt.pt" if target == "path" else io.BytesIO()
    save_checkpoint(model, optimizer, 3, out)
    train_steps(model, optimizer, 3, seed=2)
    expected = parameters(model)

    fresh_model, fresh_optimizer = model_and_optimizer(seed=99)
    if target == "file":
        out.seek(0)
    assert load_checkpoint(out, fresh_model, fresh_optimizer) == 3
    train_steps(fresh_model, fresh_optimizer, 3, seed=2)
    for a, b in zip(parameters(fresh_model), expected, strict=True):
        assert torch.equal(a, b)


def test_saved_keys_are_the_specification_names_even_for_a_compiled_model(tmp_path):
    model, optimizer = model_and_optimizer()
    compiled = torch.compile(model)  # not run: only its parameter names matter here
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    save_checkpoint(compiled, optimizer, 0, tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(state["model"]) == SPEC_KEYS
    assert state["model_config"] == CONFIG.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind


def test_prefixed_names_load_into_a_plain_model(tmp_path):
    model, optimizer = model_and_optimizer(seed=1)
    prefixed = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": prefixed, "optimizer": optimizer.state_dict(), "iteration": 7}, tmp_path / "p.pt")
    plain, _ = model_and_optimizer(seed=2)
    assert load_checkpoint(tmp_path / "p.pt", plain) == 7
    for a, b in zip(parameters(plain), parameters(model), strict=True):
        assert torch.equal(a, b)


def test_extra_entries_are_kept(tmp_path):
    model, optimizer = model_and_optimizer()
    save_checkpoint(model, optimizer, 5, tmp_path / "e.pt", train_config={"data": {"tokenizer": "tok"}})
    assert torch.load(tmp_path / "e.pt", weights_only=True)["train_config"] == {"data": {"tokenizer": "tok"}}


def test_latest_and_pruning(tmp_path):
    run = RunDirectory(tmp_path)
    assert run.latest_checkpoint() is None
    model, optimizer = model_and_optimizer()
    for step in (5, 40, 100, 7):
        save_checkpoint(model, optimizer, step, run.checkpoint(step))
    assert run.latest_checkpoint() == tmp_path / "checkpoints" / "step_00000100.pt"
    run.prune_checkpoints(2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000040.pt",
        "step_00000100.pt",
    ]


def test_load_trained_from_a_run_directory(tmp_path):
    model, optimizer = model_and_optimizer()
    train_steps(model, optimizer, 2, seed=3)
    save_checkpoint(model, optimizer, 1, RunDirectory(tmp_path).checkpoint(1))
    train_steps(model, optimizer, 1, seed=4)
    save_checkpoint(
        model, optimizer, 2, RunDirectory(tmp_path).checkpoint(2), train_config={"data": {"tokenizer": "t"}}
    )
    trained = load_trained(tmp_path)
    loaded = trained.model
    assert not loaded.training
    assert (
        trained.train_config == {"data": {"tokenizer": "t"}} and trained.checkpoint.name == "step_00000002.pt"
    )
    ids = torch.randint(0, 64, (2, 8))
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_errors_name_the_file(tmp_path):
    model, _ = model_and_optimizer()
    with pytest.raises(ScratchlmError, match=r"missing\.pt not found"):
        load_checkpoint(tmp_path / "missing.pt", model)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ScratchlmError, match=r"junk\.pt is not a scratchlm checkpoint"):
        load_checkpoint(tmp_path / "junk.pt", model)
    with pytest.raises(ScratchlmError, match="has no checkpoints"):
        load_trained(tmp_path)
    other = TransformerLM.from_config(
        ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2)
    )
    save_checkpoint(other, AdamW(other.parameters()), 0, tmp_path / "other.pt")
    with pytest.raises(ScratchlmError, match="does not fit the model"):
        load_checkpoint(tmp_path / "other.pt", model)


@pytest.mark.parametrize("kind", ["empty", "objects", "truncated", "garbage", "directory"])
def test_an_unreadable_checkpoint_is_one_line_naming_the_file(tmp_path, kind):
    """An empty file, a torch file of arbitrary Python objects (which `weights_only` refuses with several
    lines of advice), a truncated checkpoint, garbage after a zip archive's signature and a directory: each is
    one line that names the file and says what is wrong."""
    path = tmp_path / "bad.pt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "objects":
        torch.save(argparse.Namespace(model={}), path)
    elif kind == "truncated":
        model, optimizer = model_and_optimizer()
        save_checkpoint(model, optimizer, 1, path)
        path.write_bytes(path.read_bytes()[:-200])
    elif kind == "garbage":
        path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    else:
        path.mkdir()
    with pytest.raises(ScratchlmError) as error:
        read_checkpoint(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    incomplete = "is not a complete checkpoint (truncated or corrupt)"
    expected = {"empty": "is empty", "objects": "not a scratchlm checkpoint", "truncated": incomplete,
                "garbage": incomplete, "directory": "is not a file"}[kind]  # fmt: skip
    assert expected in message and not message.endswith(": ")


def test_a_checkpoint_cut_or_overwritten_anywhere_says_what_is_wrong_in_words(tmp_path):
    """Cut short at any length, or with 8 bytes overwritten anywhere, a checkpoint is refused with one line
    that names the file and says in words what is wrong, never with the raw reason torch's reader met (an
    "[Errno 22] Invalid argument", a KeyError's "255")."""
    model, optimizer = model_and_optimizer()
    save_checkpoint(model, optimizer, 1, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    path = tmp_path / "bad.pt"
    incomplete = "is not a complete checkpoint (truncated or corrupt): PyTorch cannot read its archive"
    for length in range(64, len(data), 101):
        path.write_bytes(data[:length])
        with pytest.raises(ScratchlmError) as error:
            read_checkpoint(path)
        assert str(error.value).startswith(f"checkpoint {path} {incomplete}"), length
    damaged = "is damaged: its content does not match"
    in_words = (incomplete, damaged, "is not a scratchlm checkpoint")
    refused = []
    for offset in range(0, len(data), 97):
        path.write_bytes(data[:offset] + b"\xff" * 8 + data[offset + 8 :])
        try:
            read_checkpoint(path)
        except ScratchlmError as e:
            refused.append(str(e))
    assert len(refused) > len(data) // 97 // 2  # most places are data or structure that is checked
    assert any(incomplete in m for m in refused) and any(damaged in m for m in refused)
    for message in refused:
        assert "\n" not in message and str(path) in message and any(p in message for p in in_words), message


@pytest.mark.parametrize("name", ["trained.pt", "imported.pt"])
def test_a_checkpoint_of_each_kind_saves_again_to_the_same_content(tmp_path, name):
    """The fixtures are the file format: a training run's checkpoint with every entry (fp16, a time budget)
    and an imported model's. Read and saved again, each is the same dict, entry for entry, in the same order,
    with the same checksum."""
    raw = torch.load(FIXTURES / name, map_location="cpu", weights_only=True)
    Checkpoint.read(FIXTURES / name).save(tmp_path / name)
    again = torch.load(tmp_path / name, map_location="cpu", weights_only=True)
    assert list(again) == list(raw) and again["sha256"] == raw["sha256"]


def test_the_fixtures_read_to_their_fields():
    trained = Checkpoint.read(FIXTURES / "trained.pt")
    raw = torch.load(FIXTURES / "trained.pt", map_location="cpu", weights_only=True)
    assert trained.step == 2 and trained.optimizer is not None and trained.imported_from is None
    assert (
        trained.tokenizer_dir == "data/tokenizer" and trained.tokenizer_fingerprint == "0123456789abcdef" * 4
    )
    state = trained.training
    assert state.config == raw["train_config"] and state.config["training"]["precision"] == "fp16"
    assert state.precision == "fp16" and state.elapsed_s == 1.5 and state.tokens == 32
    assert state.time_budget == {"step": 2, "step_s": 0.5, "elapsed_s": 1.0, "total_steps": 100}
    assert state.loss_scale == {"scale": 65536.0, "clean_steps": 0, "skipped": 1}
    assert state.data_rng == raw["data_rng"] and torch.equal(state.torch_rng, raw["torch_rng"])
    assert torch.equal(state.cuda_rng, torch.arange(16, dtype=torch.uint8))
    imported = Checkpoint.read(FIXTURES / "imported.pt")
    assert imported.step == 0 and imported.optimizer is None and imported.imported_from == "/models/tiny"
    assert imported.training is None and imported.tokenizer_dir is None
    assert imported.tokenizer_fingerprint == "0123456789abcdef" * 4
    model = TransformerLM(imported.model_config)
    assert load_checkpoint(imported, model) == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.model.items())
