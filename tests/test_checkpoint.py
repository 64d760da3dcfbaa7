"""save_checkpoint / load_checkpoint / latest_checkpoint / load_model."""

import io

import pytest
import torch

from scratchlm import AdamW, cross_entropy, load_checkpoint, load_model, save_checkpoint
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.training.checkpoint import checkpoint_path, latest_checkpoint, prune_checkpoints

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
    assert latest_checkpoint(tmp_path) is None
    model, optimizer = model_and_optimizer()
    for step in (5, 40, 100, 7):
        save_checkpoint(model, optimizer, step, checkpoint_path(tmp_path, step))
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000100.pt"
    prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000040.pt",
        "step_00000100.pt",
    ]


def test_load_model_from_a_run_directory(tmp_path):
    model, optimizer = model_and_optimizer()
    train_steps(model, optimizer, 2, seed=3)
    save_checkpoint(model, optimizer, 1, checkpoint_path(tmp_path, 1))
    train_steps(model, optimizer, 1, seed=4)
    save_checkpoint(
        model, optimizer, 2, checkpoint_path(tmp_path, 2), train_config={"data": {"tokenizer": "t"}}
    )
    loaded, train_config = load_model(tmp_path)
    assert not loaded.training
    assert train_config == {"data": {"tokenizer": "t"}}
    ids = torch.randint(0, 64, (2, 8))
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_errors_name_the_file(tmp_path):
    model, _ = model_and_optimizer()
    with pytest.raises(ScratchlmError, match=r"missing\.pt not found"):
        load_checkpoint(tmp_path / "missing.pt", model)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ScratchlmError, match=r"junk\.pt could not be read"):
        load_checkpoint(tmp_path / "junk.pt", model)
    with pytest.raises(ScratchlmError, match="has no checkpoints"):
        load_model(tmp_path)
    other = TransformerLM.from_config(
        ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2)
    )
    save_checkpoint(other, AdamW(other.parameters()), 0, tmp_path / "other.pt")
    with pytest.raises(ScratchlmError, match="does not fit the model"):
        load_checkpoint(tmp_path / "other.pt", model)
