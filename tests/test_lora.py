"""LoRA (scratchlm.model.lora, `scratchlm sft --lora`): the layer against a dense reference, training that
changes the adapters only, checkpoints of the adapters alone, merging, and the bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_state, last_checkpoint, sft_test_config
from interop_helpers import assert_one_line_error, run_cli
from serve_helpers import chat_run

from scratchlm.chat.conversations import write_conversations
from scratchlm.chat.tasks import build_tasks
from scratchlm.model.config import LoRAConfig, ModelConfig
from scratchlm.model.layers import Linear
from scratchlm.model.lora import Adapters, add_lora, apply_lora, merge_lora
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.load import load_trained
from scratchlm.training.trainer import train

CONTEXT = 64
TINY = ModelConfig(
    vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48
)


def adapted(rank: int = 4, alpha: float = 0.0, seed: int = 0) -> tuple[TransformerLM, TransformerLM]:
    """A tiny model and an adapted copy of it."""
    torch.manual_seed(seed)
    base = TransformerLM(TINY)
    model = TransformerLM(TINY)
    model.load_state_dict(base.state_dict())
    apply_lora(model, Adapters(LoRAConfig(rank, alpha)))
    return base, model


def test_the_layer_and_its_gradients_match_a_dense_reference():
    torch.manual_seed(0)
    layer = Linear(12, 10)
    add_lora(layer, rank=3, scaling=5.0 / 3)
    with torch.no_grad():
        layer.lora_B.normal_()  # B = 0 at first: a reference with B = 0 would not see B's gradient
    w, a, b = (t.detach().clone().requires_grad_() for t in (layer.weight, layer.lora_A, layer.lora_B))
    x = torch.randn(2, 5, 12)
    y = layer(x)
    expected = F.linear(x, w + (5.0 / 3) * (b @ a))  # (W + s B A) x
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    (expected * upstream).sum().backward()
    for ours, theirs in ((layer.weight, w), (layer.lora_A, a), (layer.lora_B, b)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_at_initialisation_the_adapted_model_is_its_base_exactly():
    base, model = adapted()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    assert torch.equal(base(ids), model(ids))
    adapted_names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapted_names and all(n.endswith((".lora_A", ".lora_B")) for n in adapted_names)
    assert len(adapted_names) == 2 * 7 * TINY.num_layers  # q, k, v, o and the three FFN matrices
    a = model.layers[0].attn.q_proj.lora_A
    assert a.abs().max() <= 1 / TINY.d_model**0.5 and a.std() > 0  # Kaiming-uniform, bound 1/sqrt(in)


def test_merging_folds_the_update_into_the_weights():
    _, model = adapted(alpha=6.0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(std=0.1)
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    before = model(ids)
    q = model.layers[1].attn.q_proj
    expected_q = q.weight + 6.0 / 4 * q.lora_B @ q.lora_A
    assert merge_lora(model) == 7 * TINY.num_layers
    assert type(q) is Linear and not hasattr(q, "lora_A")
    torch.testing.assert_close(q.weight, expected_q)
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)


def test_an_unknown_target_is_named():
    from scratchlm.errors import ScratchlmError

    model = TransformerLM(TINY)
    with pytest.raises(ScratchlmError, match="'qkv'"):
        apply_lora(model, Adapters(LoRAConfig(4, targets=("q_proj", "qkv"))))


HEAD_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3", "lm_head")


@pytest.mark.parametrize("base_dtype", [None, torch.bfloat16])
def test_an_adapted_head_trains_through_the_fused_loss_as_a_dense_reference(base_dtype):
    """The head's adapter in the training loss (the fused head and loss, which never makes the logits) against
    F.cross_entropy over `softcap(x (W + s B A)ᵀ)` made densely: the same loss and the same gradients for A and
    B, with the base's head in float32 and stored in bf16."""
    config = ModelConfig(**(TINY.__dict__ | {"logit_softcap": 15.0}))
    torch.manual_seed(0)
    model = TransformerLM(config)
    apply_lora(model, Adapters(LoRAConfig(4, targets=HEAD_TARGETS)), base_dtype=base_dtype)
    head = model.lm_head
    with torch.no_grad():
        head.lora_B.normal_(std=0.5)
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss = model(ids, targets=targets)
    loss.backward()
    hidden = {}
    model.ln_final.register_forward_hook(lambda _m, _i, out: hidden.setdefault("x", out.detach()))
    model(ids)
    a, b = (t.detach().clone().requires_grad_() for t in (head.lora_A, head.lora_B))
    logits = F.linear(hidden["x"], head.weight.detach().float() + head.scaling * (b @ a))
    expected = F.cross_entropy((15.0 * torch.tanh(logits / 15.0)).flatten(0, 1), targets.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.lora_A.grad, a.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.lora_B.grad, b.grad, rtol=1e-4, atol=1e-6)
    assert head.weight.grad is None and head.lora_B.grad.abs().sum() > 0


def test_an_adapted_head_merges_and_a_tied_head_is_refused():
    from scratchlm.errors import ScratchlmError

    torch.manual_seed(0)
    model = TransformerLM(TINY)
    apply_lora(model, Adapters(LoRAConfig(4, targets=HEAD_TARGETS)))
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(std=0.1)
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    before = model(ids)
    assert merge_lora(model) == 7 * TINY.num_layers + 1
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    tied = TransformerLM(ModelConfig(**(TINY.__dict__ | {"tie_embeddings": True})))
    with pytest.raises(ScratchlmError, match="'lm_head'.*tied"):
        apply_lora(tied, Adapters(LoRAConfig(4, targets=HEAD_TARGETS)))


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory):
    """A tiny chat run (its tokenizer has the chat tokens) and built-in conversations."""
    root = tmp_path_factory.mktemp("lora")
    base = chat_run(root / "base", context=CONTEXT, seed=0)
    train_set, test_set = build_tasks(200, 10, seed=1)
    write_conversations(root / "train.jsonl", train_set)
    write_conversations(root / "valid.jsonl", test_set)
    return root, base


def lora_config(root, base, run: str, *extra: str, steps: int = 8):
    return sft_test_config(
        root,
        base,
        run,
        "training.batch_size=4",
        f"training.max_steps={steps}",
        "schedule.cosine_cycle_iters=8",
        "optimizer.lr=0.01",
        "eval.interval=4",
        "eval.iters=1",
        "checkpoint.interval=4",
        "lora.rank=4",
        *extra,
    )


def test_training_changes_the_adapters_only_and_checkpoints_hold_them_alone(chat_base):
    root, base = chat_base
    base_state = {k: v.clone() for k, v in load_trained(base).model.state_dict().items()}
    train(lora_config(root, base, "lora"))
    saved = last_checkpoint(root / "lora")
    assert saved["model"] and all(k.endswith((".lora_A", ".lora_B")) for k in saved["model"])
    assert saved["lora"]["rank"] == 4 and saved["lora"]["base"] == str(base.resolve())
    assert any(v.abs().sum() > 0 for k, v in saved["model"].items() if k.endswith("lora_B"))  # B has moved
    # The merged model, computed here from the saved factors: W + (α/r) B A with α = 2r.
    expected = dict(base_state)
    for key, b in saved["model"].items():
        if key.endswith(".lora_B"):
            stem = key.removesuffix(".lora_B")
            expected[f"{stem}.weight"] = (
                base_state[f"{stem}.weight"] + 2.0 * b @ saved["model"][f"{stem}.lora_A"]
            )
    merged = load_trained(root / "lora").model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)
    # The base itself is untouched, bit for bit.
    for key, value in load_trained(base).model.state_dict().items():
        assert torch.equal(value, base_state[key]), key


def test_a_lora_run_resumes_bit_for_bit(chat_base):
    root, base = chat_base
    train(lora_config(root, base, "straight"))
    train(lora_config(root, base, "resumed", steps=4))
    train(lora_config(root, base, "resumed"), resume=True)
    assert_same_state(last_checkpoint(root / "straight"), last_checkpoint(root / "resumed"))


def test_a_base_that_changed_or_moved_is_refused(chat_base, tmp_path):
    from scratchlm.errors import ScratchlmError

    root, _ = chat_base
    import shutil

    base = shutil.copytree(root / "base", tmp_path / "base")
    train(lora_config(root, base, "moving", steps=4))
    checkpoint = next((base / "checkpoints").iterdir())
    state = torch.load(checkpoint, weights_only=True)
    state["model"]["ln_final.weight"] = state["model"]["ln_final.weight"] * 1.5
    state.pop("sha256")
    torch.save(state, checkpoint)
    with pytest.raises(ScratchlmError, match="has changed"):
        load_trained(root / "moving")
    with pytest.raises(ScratchlmError, match="not the one the adapters"):
        train(lora_config(root, base, "moving", steps=8), resume=True)
    shutil.rmtree(base)
    with pytest.raises(ScratchlmError, match="not found"):
        load_trained(root / "moving")


@pytest.mark.parametrize("rank", ["0", "-2"])
def test_a_rank_below_one_is_named(rank, capsys):
    status, _, err = run_cli(["sft", "--base", "b", "--data", "d.jsonl", "--lora", rank], capsys)
    assert_one_line_error(status, err, f"--lora {rank}")


def test_lora_with_a_command_that_trains_no_adapters_is_named(capsys):
    status, _, err = run_cli(["train", "--config", "c.toml", "--lora", "8"], capsys)
    assert_one_line_error(status, err, "--lora", "scratchlm train")


def test_a_pretraining_config_with_lora_is_refused():
    from scratchlm.errors import ScratchlmError
    from scratchlm.training.config import TrainConfig

    with pytest.raises(ScratchlmError, match=r"lora.rank = 4"):
        TrainConfig.load(
            None, ["lora.rank=4", "data.train='a.npy'", "data.valid='b.npy'", "training.max_steps=1"]
        )


def test_without_targets_every_matrix_of_the_bases_blocks_is_adapted(chat_base):
    """A base whose feed-forward network has no gate (ReLU², the fast recipe's, the quickstart's): `--lora`
    alone adapts every matrix its blocks have, and its head (untied here); naming the gate `w3` it lacks is
    refused, naming it."""
    from scratchlm.errors import ScratchlmError

    root, _ = chat_base
    base = chat_run(root / "relu2", context=CONTEXT, seed=0, ffn="relu2")
    layers = load_trained(base).model.layers
    matrices = {f"layers.{name}" for name, m in layers.named_modules() if isinstance(m, Linear)}
    assert len(matrices) == 2 * 6 and not any(name.endswith("w3") for name in matrices)
    train(lora_config(root, base, "relu2-lora", steps=4))
    saved = last_checkpoint(root / "relu2-lora")
    assert not load_trained(base).model.config.tie_embeddings
    assert {key.removesuffix(".lora_A") for key in saved["model"] if key.endswith(".lora_A")} == matrices | {
        "lm_head"
    }
    with pytest.raises(ScratchlmError, match="'w3'"):
        train(lora_config(root, base, "relu2-gate", "lora.targets=['q_proj', 'w3']"))


@pytest.fixture(scope="module")
def lora_run(chat_base):
    root, base = chat_base
    train(lora_config(root, base, "exported"))
    return root / "exported", base


def unmerged(run, base) -> TransformerLM:
    """The LoRA run's model as it trained: its base with the saved adapters on it, not merged."""
    from scratchlm.model.lora import load_trainable

    saved = last_checkpoint(run)
    model = load_trained(base).model
    apply_lora(model, Adapters.from_dict(saved["lora"]))
    load_trainable(model, saved["model"], "test")
    return model.eval()


@pytest.fixture(scope="module")
def head_run(chat_base):
    """A LoRA run with an adapter on the head too and the token embeddings trained whole (`lora.train`)."""
    root, base = chat_base
    targets = "lora.targets=['q_proj','k_proj','v_proj','output_proj','w1','w2','w3','lm_head']"
    train(lora_config(root, base, "head", targets, "lora.train=['token_embeddings']"))
    return root / "head", base


@pytest.mark.parametrize("which", ["lora_run", "head_run"])
def test_peft_loads_the_exported_adapter_onto_the_base_export_with_the_same_logits(
    which, request, tmp_path, capsys
):
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import peft

    run, base = request.getfixturevalue(which)
    status, _, err = run_cli(
        ["export", "--run", str(base), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert status == 0, err
    status, out, err = run_cli(
        ["export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "a")], capsys
    )
    assert status == 0, err + out
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    if which == "head_run":
        assert "lm_head" in config["target_modules"] and config["modules_to_save"] == ["embed_tokens"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a")).float().eval()
    ids = torch.randint(0, 200, (2, 24))
    ours = unmerged(run, base)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
        # The adapters matter: peft without them gives other logits.
        with model.disable_adapter():
            assert not torch.allclose(model(ids).logits, ours(ids), atol=1e-4)


def test_the_merged_export_has_the_lora_models_logits(lora_run, tmp_path, capsys):
    run, base = lora_run
    out = tmp_path / "merged.pt"
    status, _, err = run_cli(
        ["export", "--run", str(run), "--format", "checkpoint", "--out", str(out)], capsys
    )
    # A LoRA run says which of the two it wants (after the line that says the run was merged as it loaded).
    assert (
        status == 2
        and err.strip().splitlines()[-1].startswith("error: --format checkpoint")
        and "--merge" in err
    )
    status, _, err = run_cli(
        ["export", "--run", str(run), "--merge", "--format", "checkpoint", "--out", str(out)], capsys
    )
    assert status == 0, err
    merged = load_trained(out).model
    ids = torch.randint(0, 200, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), unmerged(run, base)(ids), rtol=1e-5, atol=1e-5)


def test_peft_of_a_run_without_adapters_is_refused(chat_base, tmp_path, capsys):
    _, base = chat_base
    status, _, err = run_cli(
        ["export", "--run", str(base), "--format", "peft", "--out", str(tmp_path / "a")], capsys
    )
    assert_one_line_error(status, err, "not a LoRA run")
