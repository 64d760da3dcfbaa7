"""`RunDirectory.create`: the one way a run is laid out, by training and by `import-hf` alike."""

from __future__ import annotations

import torch

from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run import Checkpoint, RunDirectory, load_trained
from scratchlm.tokenizer.tokenizer import Tokenizer


def byte_tokenizer(extra: bytes = b"") -> Tokenizer:
    """A tokenizer of the 256 bytes (plus one merge when `extra` is given) and <|endoftext|>."""
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(extra[:1], extra[1:])] if extra else []
    if extra:
        vocab[256] = extra
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def test_create_writes_the_config_the_tokenizer_and_a_first_checkpoint(tmp_path):
    run = RunDirectory(tmp_path / "run")
    torch.manual_seed(0)
    model = TransformerLM.from_config(
        ModelConfig(vocab_size=300, context_length=8, d_model=16, num_layers=1, num_heads=2)
    )
    tokenizer = byte_tokenizer()
    run.create(
        "[model]\nvocab_size = 300\n",
        tokenizer,
        Checkpoint.of(model, 0, tokenizer_fingerprint=tokenizer.fingerprint),
    )
    assert run.config.read_text() == "[model]\nvocab_size = 300\n"
    assert Tokenizer.from_dir(run.tokenizer_dir).fingerprint == tokenizer.fingerprint
    assert run.checkpoints() == [run.checkpoint(0)]
    trained = load_trained(run.path)  # the run alone is enough: its model and its own tokenizer
    assert trained.tokenizer.fingerprint == tokenizer.fingerprint
    for name, tensor in model.state_dict().items():
        assert torch.equal(trained.model.state_dict()[name], tensor)
    saved = torch.load(run.checkpoint(0), weights_only=False)
    assert not saved.get("optimizer")  # imported weights come with no optimizer state


def test_create_keeps_the_tokenizer_copy_a_run_already_has(tmp_path):
    """A resumed run rewrites its config but never the tokenizer its checkpoints were trained with."""
    run = RunDirectory(tmp_path / "run")
    first, other = byte_tokenizer(), byte_tokenizer(b"ab")
    assert first.fingerprint != other.fingerprint
    run.create("a = 1\n", first)
    run.create("a = 2\n", other)
    assert run.config.read_text() == "a = 2\n"
    assert Tokenizer.from_dir(run.tokenizer_dir).fingerprint == first.fingerprint
    assert not list(run.path.glob(".*.tmp-*"))  # atomic writes leave nothing behind
