"""Reinforcement learning with verifiable rewards (scratchlm.chat.rl, `scratchlm rl`): a toy problem learnt,
exact resume, groups that teach nothing, and rewards or prompts that fail."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import assert_same_state
from interop_helpers import assert_one_line_error, run_cli
from serve_helpers import chat_run

from scratchlm.chat.conversations import read_conversations
from scratchlm.chat.rl.prompts import read_prompts
from scratchlm.chat.rl.rewards import RewardError
from scratchlm.chat.rl.rollouts import sample_replies
from scratchlm.chat.rl.stage import load_prompts, rl_config
from scratchlm.chat.template import chat_template
from scratchlm.errors import ScratchlmError
from scratchlm.experiments.plot import plot_runs
from scratchlm.run import Checkpoint, RunDirectory
from scratchlm.run.load import load_trained
from scratchlm.training.trainer import train

# A word the tiny random chat model writes in about 4 % of its replies (one of its tokens, " data").
WORD = "data"
TOPICS = [
    "cats",
    "dogs",
    "rain",
    "the sea",
    "bread",
    "time",
    "music",
    "snow",
    "trees",
    "books",
    "light",
    "roads",
]


@pytest.fixture(scope="module")
def base_and_prompts(tmp_path_factory):
    """A tiny random chat run, and prompts whose answer is `WORD`."""
    root = tmp_path_factory.mktemp("rl")
    base = chat_run(root / "base", context=64, seed=0)
    with open(root / "prompts.jsonl", "w") as f:
        for topic in TOPICS:
            messages = [{"role": "user", "content": f"Say something about {topic}."}]
            f.write(json.dumps({"messages": messages, "answer": WORD}) + "\n")
    return root, base


def config_for(root, base, run: str, *extra: str, steps: int = 30):
    overrides = [
        f"rl.base={json.dumps(str(base))}",
        f"rl.train={json.dumps(str(root / 'prompts.jsonl'))}",
        "rl.valid_fraction=0.2",
        "rl.reward='contains'",
        "rl.max_reply_tokens=16",
        f"logging.run_dir={json.dumps(str(root / run))}",
        "training.device='cpu'",
        "training.precision='fp32'",
        "training.batch_size=64",
        f"training.max_steps={steps}",
        "optimizer.lr=1e-2",
        "optimizer.min_lr=1e-3",
        "schedule.cosine_cycle_iters=30",
        "eval.interval=10",
        "checkpoint.interval=2",
        *extra,
    ]
    return rl_config(None, overrides)


def share_saying_the_word(run) -> float:
    """The share of 240 replies sampled at temperature 1 (20 to each prompt) that contain `WORD`."""
    trained = load_trained(run)
    tokenizer, template = trained.tokenizer, chat_template(trained.tokenizer)
    prompts = [template.encode(p.messages) for p in read_prompts(run.parent / "prompts.jsonl")] * 20
    replies = sample_replies(
        trained.model, prompts, 16, 1.0, list(range(len(prompts))), tokenizer.eos_id, template.stop_ids
    )
    texts = [tokenizer.decode([t for t in reply if t not in template.stop_ids]) for reply in replies]
    return float(np.mean([WORD in text for text in texts]))


def records(run_dir, key: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def test_a_word_the_model_rarely_says_is_said_in_nine_replies_of_ten(base_and_prompts):
    root, base = base_and_prompts
    assert share_saying_the_word(base) < 0.15
    summary = train(config_for(root, base, "learnt"))
    assert summary.steps == 30
    assert share_saying_the_word(root / "learnt") >= 0.9
    logged = records(root / "learnt", "reward")
    assert len(logged) == 30 and logged[-1]["reward"] > logged[0]["reward"]
    for key in ("uniform_groups", "clip_fraction", "reply_tokens", "entropy"):
        assert all(math_finite(r[key]) for r in logged), key
    assert all(r.get("kl") is None for r in logged)  # no penalty: no pass of the starting model to measure it
    passes = records(root / "learnt", "val_pass1")
    assert [r["step"] for r in passes] == [10, 20, 30] and passes[-1]["val_pass1"] >= 0.9
    drawn = plot_runs([root / "learnt"], root / "reward.png", metric="reward")["learnt"]
    assert len(drawn["train"]["reward"]) == 30 and drawn["val"]["reward"] == [r["val_pass1"] for r in passes]
    # The result is a chat run like its base.
    trained = load_trained(root / "learnt")
    assert chat_template(trained.tokenizer) is not None
    assert trained.model.config == load_trained(base).model.config


def math_finite(value) -> bool:
    return value is not None and np.isfinite(value)


def test_rl_resumes_bit_for_bit(base_and_prompts):
    """Several optimizer steps a batch and the KL penalty's reference included: the prompts and the replies'
    seeds come from the generator the checkpoints keep."""
    root, base = base_and_prompts
    extra = ("rl.epochs_per_batch=2", "rl.kl_coef=0.1", "rl.length_norm='sequence'", "rl.normalize_std=true")
    train(config_for(root, base, "straight", *extra, steps=4))
    train(config_for(root, base, "resumed", *extra, steps=2))
    train(config_for(root, base, "resumed", *extra, steps=4), resume=True)
    final = [
        torch.load(sorted((root / run / "checkpoints").iterdir())[-1]) for run in ("straight", "resumed")
    ]
    assert_same_state(*final)
    losses = [[r["train_loss"] for r in records(root / run, "train_loss")] for run in ("straight", "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert any(r["clip_fraction"] > 0 for r in records(root / "straight", "clip_fraction"))
    assert any(r["kl"] > 0 for r in records(root / "straight", "kl"))


def test_groups_whose_rewards_are_all_equal_teach_nothing(base_and_prompts):
    """A reward no reply gets: every group is uniform, no step changes the model."""
    root, base = base_and_prompts
    train(config_for(root, base, "uniform", "rl.reward='exact'", steps=2))
    logged = records(root / "uniform", "reward")
    assert [r["uniform_groups"] for r in logged] == [1.0, 1.0] and [r["reward"] for r in logged] == [0.0, 0.0]
    before, after = load_trained(base).model.state_dict(), load_trained(root / "uniform").model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_only_the_replies_of_groups_that_teach_are_kept(base_and_prompts, monkeypatch):
    """The rows of a uniform group never reach a forward pass: a batch keeps the teaching groups' replies with
    their advantages (reward minus the group's mean, by hand), or, when none teaches, every reply with no row
    counted."""
    root, base = base_and_prompts
    config = config_for(root, base, "kept", "training.batch_size=12", "rl.group_size=4")
    data = load_prompts(config, RunDirectory(root / "kept"))
    policy = load_trained(base).model
    rewards = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]  # the middle group teaches
    monkeypatch.setattr(type(data.train), "_rewards", lambda self, indices, replies: rewards)
    rows = data.train.draw(12, np.random.default_rng(0), policy)
    assert len(rows) == 4 and data.train.counted(rows) == 4
    assert rows.advantages.tolist() == [-0.25, 0.75, -0.25, -0.25]
    rewards[:] = [0.0] * 12
    rows = data.train.draw(12, np.random.default_rng(0), policy)
    assert len(rows) == 12 and data.train.counted(rows) == 0
    assert data.train.metrics()["uniform_groups"] == pytest.approx((2 / 3 + 1) / 2)


REWARDS = """
import time
calls = 0

def after_two_steps(behaviour):
    def reward(reply, answer, messages):
        global calls
        calls += 1
        if calls <= 128:  # two steps of 64 replies
            return float(answer in reply)
        return behaviour()
    return reward

def fail():
    raise ZeroDivisionError("division by zero")

def hang():
    time.sleep(30)

raises = after_two_steps(fail)
nan = after_two_steps(lambda: float("nan"))
hangs = after_two_steps(hang)
"""


@pytest.mark.parametrize(
    "function, message",
    [
        ("raises", "raised ZeroDivisionError: division by zero on the prompt of"),
        ("nan", "returned nan on the prompt of"),
        ("hangs", "ran longer than 0.5 s on the prompt of"),
    ],
)
def test_a_reward_that_fails_is_one_line_and_the_last_checkpoint_is_intact(
    base_and_prompts, tmp_path, function, message
):
    root, base = base_and_prompts
    (tmp_path / "rewards.py").write_text(REWARDS)
    reward = f"{tmp_path / 'rewards.py'}:{function}"
    config = config_for(root, base, f"failing-{function}", f"rl.reward={json.dumps(reward)}",
                        "rl.reward_timeout_s=0.5", steps=6)  # fmt: skip
    with pytest.raises(RewardError, match=f"^reward {reward} {message} {root / 'prompts.jsonl'}:[0-9]+"):
        train(config)
    checkpoints = sorted((root / f"failing-{function}" / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step_00000002.pt"]
    assert Checkpoint.read(checkpoints[-1]).step == 2  # its checksum holds


def test_the_command_names_a_failing_reward_or_a_bad_prompt_in_one_line(base_and_prompts, tmp_path, capsys):
    root, base = base_and_prompts
    (tmp_path / "rewards.py").write_text("def wrong(reply, answer, messages):\n    return 'yes'\n")
    reward = f"{tmp_path / 'rewards.py'}:wrong"
    common = [
        "--base",
        str(base),
        "--device",
        "cpu",
        "--set",
        "training.max_steps=1",
        "--set",
        "training.batch_size=8",
    ]
    status, _, err = run_cli(
        [
            "rl",
            *common,
            "--data",
            str(root / "prompts.jsonl"),
            "--reward",
            reward,
            "--out",
            str(tmp_path / "a"),
        ],
        capsys,
    )
    # The run had started (its console lines come first): the error is its last line, alone.
    assert status == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"error: reward {reward} returned 'yes' on the prompt of {root / 'prompts.jsonl'}:"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}], "answer": "yo"}\n'
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answer": "x"}\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    status, _, err = run_cli(["rl", *common, "--data", str(bad), "--out", str(tmp_path / "b")], capsys)
    assert_one_line_error(status, err, f"{bad}:2: the conversation must end with the user's question")
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ScratchlmError, match=f'{bad}:1: no "answer" string'):
        read_prompts(bad)
    assert not (tmp_path / "b").exists()  # refused before the run directory is claimed


def test_the_quickstart_goes_on_to_reinforcement_learning(tmp_path):
    """`quickstart --chat --rl` (small): the chat model trained by RL on the same tasks, and the base, chat and
    RL models scored on the same held-out conversations."""
    from scratchlm.chat.pipeline import CHAT_SMALL
    from scratchlm.quickstart import quickstart

    with pytest.raises(ScratchlmError, match="add --chat"):
        quickstart(tmp_path / "refused", small=True, device="cpu", rl_minutes=1)
    out = tmp_path / "qs"
    result = quickstart(out, minutes=1, small=True, device="cpu", chat_minutes=1, rl_minutes=1)
    chat = result.chat
    assert chat is not None and chat.rl_steps == 4 and chat.rl_run_dir == str(out / "rl-run")
    assert 0 <= chat.exact_match_rl <= 1 and np.isfinite(chat.loss_rl)
    assert chat_template(load_trained(out / "rl-run").tokenizer) is not None
    assert records(out / "rl-run", "val_pass1")  # the held-out prompts were evaluated
    recorded = json.loads((out / "quickstart.json").read_text())["chat"]
    assert recorded["exact_match_rl"] == chat.exact_match_rl
    # RL's prompts are questions neither fine-tuning nor the test asks; its validation is the test's.
    last_questions = lambda path: [json.loads(line)["messages"][-1]["content"] for line in path.open()]  # noqa: E731
    fine_tuned = {c[-2].content for c in read_conversations(out / "chat" / "train.jsonl")}
    tested = [c[-2].content for c in read_conversations(out / "chat" / "test.jsonl")]
    rl_questions = last_questions(out / "chat" / "rl-train.jsonl")
    assert len(rl_questions) == CHAT_SMALL.train_conversations  # as many as fine-tuning had
    assert not set(rl_questions) & (fine_tuned | set(tested))
    assert last_questions(out / "chat" / "rl-test.jsonl") == tested


def test_the_example_config_reads_as_documented(base_and_prompts):
    """configs/chat-rl.toml: its settings over reinforcement learning's defaults, the model the base's."""
    from pathlib import Path

    from scratchlm.chat.rl.stage import RL_DEFAULTS

    root, base = base_and_prompts
    example = Path(__file__).resolve().parent.parent / "configs" / "chat-rl.toml"
    paths = {"rl.base": base, "rl.train": root / "prompts.jsonl", "rl.valid": root / "prompts.jsonl"}
    config = rl_config(example, [f"{key}={json.dumps(str(value))}" for key, value in paths.items()])
    assert (config.optimizer.lr, config.training.max_time_s, config.rl.max_reply_tokens) == (8e-4, 180, 32)
    assert config.training.batch_size == RL_DEFAULTS["training"]["batch_size"]
    assert config.model == load_trained(base).model.config and config.training.init_from == str(base)
    with pytest.raises(ScratchlmError, match=r"an RL config has no \[model\]"):
        (root / "with-model.toml").write_text(example.read_text() + "\n[model]\nd_model = 64\n")
        rl_config(root / "with-model.toml")


def test_train_refuses_a_config_of_another_stage_naming_its_command(tmp_path, capsys):
    for stage in ("sft", "rl"):
        config = tmp_path / f"{stage}.toml"
        config.write_text(f'[{stage}]\nbase = "runs/x"\n')
        status, _, err = run_cli(["train", "--config", str(config)], capsys)
        assert_one_line_error(status, err, f"a config with [{stage}] is for `scratchlm {stage}`")


@pytest.mark.parametrize(
    "setting, message",
    [
        ("rl.group_size=1", "rl.group_size must be at least 2"),
        ("rl.temperature=0", "rl.temperature must be above 0"),
        ("rl.clip_eps=1.5", r"rl.clip_eps must lie in \(0, 1\)"),
        ("rl.length_norm='tokens'", "rl.length_norm must be one of 'sequence', 'constant'"),
        ("training.batch_size=12", "must be a multiple of rl.group_size"),
    ],
)
def test_settings_are_checked_before_anything_runs(base_and_prompts, setting, message):
    root, base = base_and_prompts
    with pytest.raises(ScratchlmError, match=message):
        config_for(root, base, "refused", setting)
    assert not (root / "refused").exists()


def test_the_finished_line_gives_the_last_pass_at_1(base_and_prompts, tmp_path, capsys):
    """A stage that validates by pass@1 has no validation loss: the run's last line says its pass@1."""
    root, base = base_and_prompts
    out = tmp_path / "run"
    args = [
        "rl",
        "--base",
        str(base),
        "--data",
        str(root / "prompts.jsonl"),
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    sets = ["training.max_steps=2", "training.batch_size=8", "eval.interval=1", "training.precision=fp32"]
    status, _, err = run_cli([*args, *(x for s in sets for x in ("--set", s))], capsys)
    assert status == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r["val_pass1"] for r in records if r.get("val_pass1") is not None][-1]
    finished = [line for line in err.splitlines() if line.startswith("finished at step 2")]
    assert len(finished) == 1 and f"val pass@1 {last:.1%};" in finished[0] and "val loss" not in finished[0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rl_runs_at_every_precision_and_records_it(base_and_prompts, precision):
    """bf16 and fp16 (autocast, and fp16's loss scaling) take the steps fp32 takes: with a KL penalty (so the KL is
    measured), the first step's loss and KL are fp32's within the bound below, and the precision is recorded."""
    root, base = base_and_prompts
    run = f"precision-{precision}"
    extra = ("rl.kl_coef=0.1",)
    summary = train(config_for(root, base, run, f"training.precision='{precision}'", *extra, steps=2))
    if not (root / "precision-fp32").exists():
        train(config_for(root, base, "precision-fp32", *extra, steps=2))
    assert summary.steps == 2 and np.isfinite(summary.final_train_loss)
    logged, exact = records(root / run, "reward"), records(root / "precision-fp32", "reward")
    assert len(logged) == 2 and all(np.isfinite([r["reward"], r["kl"], r["entropy"]]).all() for r in logged)
    # At the first step the policy is the starting model and is sampled with the same seeds. The loss is
    # -A · ρ / max_reply_tokens summed over tokens with ρ = exp(logπ - logπ.detach()) = 1 exactly, plus β·KL
    # with KL = 0 exactly (the reference is the same weights run the same way): it depends on the rewards and
    # reply lengths only, which are fp32's unless rounding the logits to the precision (a relative 2^-8 for
    # bf16) moved a sampled token across a boundary of the inverse CDF. Those happen with probability about
    # 2^-8 per token; a changed reply moves the loss by at most |A| · 16 / 16 / 64 rows < 1/64.
    assert logged[0]["kl"] == exact[0]["kl"] == 0.0
    first = [records(root / name, "train_loss")[0]["train_loss"] for name in (run, "precision-fp32")]
    assert abs(first[0] - first[1]) < 1 / 64, first
    assert Checkpoint.read(sorted((root / run / "checkpoints").iterdir())[-1]).training.precision == precision


def test_a_base_that_does_not_exist_is_named_with_its_flag(tmp_path, capsys):
    missing = tmp_path / "nope"
    status, _, err = run_cli(
        ["rl", "--base", str(missing), "--data", str(tmp_path / "prompts.jsonl")], capsys
    )
    assert_one_line_error(status, err, "--base", str(missing), "not found")
