"""Supervised fine-tuning of a base run (scratchlm.chat.sft, `scratchlm sft`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state, last_checkpoint, scratchlm_command, sft_test_config
from interop_helpers import assert_one_line_error, run_cli
from serve_helpers import tiny_run

from scratchlm.chat.conversations import write_conversations
from scratchlm.chat.tasks import build_tasks
from scratchlm.chat.template import JINJA, ChatTemplate, chat_template
from scratchlm.errors import ScratchlmError
from scratchlm.run.load import load_trained
from scratchlm.tokenizer import CHAT_TOKENS
from scratchlm.training.config import TrainConfig
from scratchlm.training.start import grow_vocabulary
from scratchlm.training.trainer import train

BASE_CONTEXT = 96


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory):
    """A tiny base run whose tokenizer lacks the chat tokens, and built-in conversations."""
    root = tmp_path_factory.mktemp("sft")
    base = tiny_run(root / "base", context=BASE_CONTEXT, seed=0)
    train_set, test_set = build_tasks(300, 20, seed=1)
    write_conversations(root / "train.jsonl", train_set)
    write_conversations(root / "valid.jsonl", test_set)
    return root, base


def config_for(root, base, run: str, *extra: str, steps: int = 12, grad_accum: int = 1):
    return sft_test_config(
        root,
        base,
        run,
        "training.batch_size=8",
        f"training.grad_accum={grad_accum}",
        f"training.max_steps={steps}",
        "schedule.cosine_cycle_iters=12",
        "eval.interval=4",
        "eval.iters=2",
        "checkpoint.interval=4",
        *extra,
    )


def test_a_base_run_is_fine_tuned_into_a_chat_model(base_and_data):
    root, base = base_and_data
    base_model = load_trained(base).model
    config = config_for(root, base, "chat")
    assert config.model.vocab_size == base_model.config.vocab_size + len(CHAT_TOKENS)
    summary = train(config)
    assert summary.steps == 12 and summary.final_val_loss is not None
    trained = load_trained(root / "chat")
    assert trained.tokenizer.chat_template == JINJA
    assert isinstance(chat_template(trained.tokenizer), ChatTemplate)
    assert (root / "chat" / "tokenizer" / "chat_template.jinja").read_text() == JINJA
    recorded = TrainConfig.load(root / "chat" / "config.toml")
    assert recorded.sft.added_tokens == CHAT_TOKENS  # the run records the tokens it added to the base's
    assert recorded.model.vocab_size == config.model.vocab_size
    losses = [json.loads(line) for line in (root / "chat" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train_loss"] for r in losses if "train_loss" in r]
    assert len(train_losses) == 12 and train_losses[-1] < train_losses[0]


def test_new_token_rows_start_as_the_mean_and_the_others_are_kept():
    torch.manual_seed(0)
    state = {
        "token_embeddings.weight": torch.randn(5, 3),
        "lm_head.weight": torch.randn(5, 3),
        "value_embeddings.0.weight": torch.randn(5, 2),
        "layers.0.attn.q_proj.weight": torch.randn(5, 5),  # 5 rows by chance: not a table of tokens
    }
    grown = grow_vocabulary(state, 7)
    for name in ("token_embeddings.weight", "lm_head.weight", "value_embeddings.0.weight"):
        assert grown[name].shape[0] == 7
        assert torch.equal(grown[name][:5], state[name])
        for row in (5, 6):
            torch.testing.assert_close(grown[name][row], state[name].mean(dim=0))
    assert torch.equal(grown["layers.0.attn.q_proj.weight"], state["layers.0.attn.q_proj.weight"])


def test_fine_tuning_resumes_bit_for_bit(base_and_data):
    root, base = base_and_data
    train(config_for(root, base, "straight"))
    train(config_for(root, base, "resumed", steps=6))
    train(config_for(root, base, "resumed"), resume=True)
    assert_same_state(last_checkpoint(root / "straight"), last_checkpoint(root / "resumed"))


# The losses of `config_for` with two micro-batches a step, as the loop computed them before fine-tuning reached
# its batches and loss through a stage (scratchlm.training.stage): bit for bit alike on the machine that
# recorded them; the tolerance leaves room for another CPU's kernels, not for a change of what is computed.
RECORDED_TRAIN_LOSSES = [
    6.497439,
    6.529861,
    6.436286,
    6.526021,
    6.425888,
    6.514745,
    6.420188,
    6.397555,
    6.489817,
    6.423487,
    6.426389,
    6.395149,
]
RECORDED_VAL_LOSSES = [6.471953, 6.446038, 6.401224]


def test_fine_tuning_computes_the_recorded_losses(base_and_data):
    root, base = base_and_data
    train(config_for(root, base, "recorded", grad_accum=2))
    records = [json.loads(line) for line in (root / "recorded" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in records if "train_loss" in r] == pytest.approx(
        RECORDED_TRAIN_LOSSES, rel=1e-4
    )
    assert [r["val_loss"] for r in records if "val_loss" in r] == pytest.approx(RECORDED_VAL_LOSSES, rel=1e-4)


def test_micro_batches_weigh_each_assistant_token_alike(base_and_data):
    """The loss is the mean over the counted tokens of the whole batch, however it is split into
    micro-batches (which hold different numbers of them): two micro-batches give the one-batch run."""
    root, base = base_and_data
    train(config_for(root, base, "one", steps=3))
    train(config_for(root, base, "two", steps=3, grad_accum=2))
    one, two = last_checkpoint(root / "one")["model"], last_checkpoint(root / "two")["model"]
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-6)


def test_a_config_may_not_set_the_model(base_and_data, tmp_path):
    root, base = base_and_data
    from scratchlm.chat.sft import sft_config

    config_file = tmp_path / "sft.toml"
    config_file.write_text(
        f'[sft]\nbase = "{base}"\ntrain = "{root / "train.jsonl"}"\n[model]\nd_model = 64\n'
    )
    with pytest.raises(ScratchlmError, match="a fine-tuning config has no \\[model\\]"):
        sft_config(config_file)
    with pytest.raises(ScratchlmError, match="sft.base is required"):
        sft_config(None, [f"sft.train={json.dumps(str(root / 'train.jsonl'))}"])


def test_the_command_reports_a_bad_line_in_one_line(base_and_data, tmp_path):
    root, base = base_and_data
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [{"role": "robot", "content": "beep"}]}\n')  # fmt: skip
    result = scratchlm_command("sft", "--base", str(base), "--data", str(bad), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    # (A device measured while other tests keep the cores busy adds a "note:" line that is not about the data.)
    lines = [
        line for line in (result.stdout + result.stderr).strip().splitlines() if not line.startswith("note:")
    ]
    assert len(lines) == 1 and f"{bad}:2: message 1 has an unknown role 'robot'" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_the_quickstart_goes_on_to_a_chat_model(tmp_path):
    """`quickstart --chat` (small): conversations, fine-tuning, both models scored, and a second call reuses
    every stage."""
    from scratchlm.quickstart import quickstart

    out = tmp_path / "qs"
    result = quickstart(out, minutes=1, small=True, device="cpu", chat_minutes=1)
    chat = result.chat
    assert chat is not None and chat.steps == 30 and chat.test_conversations == 20
    assert 0 <= chat.exact_match_before <= 1 and 0 <= chat.exact_match_after <= 1
    assert chat.loss_after < chat.loss_before  # fine-tuning lowered the held-out assistant loss
    assert isinstance(chat_template(load_trained(out / "chat-run").tokenizer), ChatTemplate)
    recorded = json.loads((out / "quickstart.json").read_text())["chat"]
    assert recorded["exact_match_after"] == chat.exact_match_after
    again = quickstart(out, minutes=1, small=True, device="cpu", chat_minutes=1)
    assert again.chat.steps == chat.steps and again.chat.loss_after == pytest.approx(chat.loss_after)


def test_an_imported_model_is_fine_tuned_too(base_and_data, tmp_path):
    """A model that comes through `import-hf` (here: a scratchlm run exported to transformers' format and
    read back) is a base like any other: the chat tokens its tokenizer lacks are added, and it trains."""
    pytest.importorskip("transformers", reason="transformers not installed (the export's check needs it)")
    from scratchlm.interop.hf import export_hf, import_hf

    root, base = base_and_data
    export_hf(load_trained(base), tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    config = config_for(root, imported, "from-import", steps=4)
    assert config.sft.added_tokens == CHAT_TOKENS
    summary = train(config)
    assert summary.steps == 4 and summary.final_val_loss is not None
    assert isinstance(chat_template(load_trained(root / "from-import").tokenizer), ChatTemplate)


def test_the_example_config_reads_as_documented(base_and_data):
    """configs/chat-sft.toml: its settings over fine-tuning's defaults, the model the base's."""
    from scratchlm.chat.sft import SFT_DEFAULTS, sft_config

    root, base = base_and_data
    example = Path(__file__).resolve().parent.parent / "configs" / "chat-sft.toml"
    paths = {"sft.base": base, "sft.train": root / "train.jsonl", "sft.valid": root / "valid.jsonl"}
    config = sft_config(example, [f"{key}={json.dumps(str(value))}" for key, value in paths.items()])
    assert (config.optimizer.lr, config.optimizer.min_lr, config.training.max_time_s) == (8e-3, 8e-4, 180)
    assert config.training.batch_size == SFT_DEFAULTS["training"]["batch_size"]
    base_model = load_trained(base).model.config
    assert config.model == dataclasses.replace(base_model, vocab_size=config.model.vocab_size)


def test_exact_match_cuts_replies_past_the_answer_and_scores_as_uncut_replies_do(tmp_path, monkeypatch):
    """The oracle: each conversation's reply written to its end of turn or the end of the context, compared
    with the answer. Half the answers are the model's own uncut replies (some run to the end of the context),
    half the tasks' answers; `exact_match` scores them the same while no reply it writes is longer than its
    answer's bytes plus one."""
    from serve_helpers import chat_run

    from scratchlm.chat import tasks
    from scratchlm.chat.template import Message

    trained = load_trained(chat_run(tmp_path / "chat", context=48, seed=1))
    model, template = trained.model, chat_template(trained.tokenizer)
    conversations, _ = build_tasks(24, 0, seed=3)
    uncut = [tasks.greedy_reply(model, template, c[:-1]) for c in conversations]
    for i, c in enumerate(conversations):
        if i % 2 == 0:
            c[-1] = Message("assistant", uncut[i])
    expected = sum(u == c[-1].content for u, c in zip(uncut, conversations, strict=True)) / len(conversations)
    assert 0.5 <= expected < 1 and max(map(len, uncut)) > 40  # some uncut replies ran long
    budgets = []
    generate = tasks.generate
    monkeypatch.setattr(
        tasks, "generate", lambda *a, **k: budgets.append(k["max_new_tokens"]) or generate(*a, **k)
    )
    assert tasks.exact_match(model, template, conversations) == expected
    assert budgets == [
        min(len(c[-1].content.encode()) + 1, max(0, 48 - len(template.encode(c[:-1])))) for c in conversations
    ]


def test_a_base_that_does_not_exist_is_named_with_its_flag(tmp_path, capsys):
    missing = tmp_path / "nope"
    status, _, err = run_cli(["sft", "--base", str(missing), "--data", str(tmp_path / "data.jsonl")], capsys)
    assert_one_line_error(status, err, "--base", str(missing), "not found")
