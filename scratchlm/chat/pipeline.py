"""From a base run to a chat model in one call: the quickstart's `--chat` stages, also the chat benchmark's.

    built-in conversations (scratchlm.chat.tasks) -> OUT/chat/{train,test}.jsonl
    the base run, fine-tuned on them for a time budget (scratchlm.chat.sft) -> OUT/chat-run
    with `--rl`: fresh conversations of the same tasks (and the test's) as prompts with their answers
    -> OUT/chat/{rl-train,rl-test}.jsonl,
    the chat model trained on them by reinforcement learning, exact-match reward, for a time budget
    (scratchlm.chat.rl) -> OUT/rl-run
    the base, the chat (and the RL) model scored on the test split: exact match of the last answer, and the
    loss of the assistant's tokens -> a short conversation with the last model

The base is scored with the same template (its tokenizer given the chat tokens, when it lacked them, as
fine-tuning does), so the two figures compare the same prompts. Like the quickstart's other stages, each one
reuses what an earlier call finished, and an interrupted fine-tuning run resumes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scratchlm.chat.conversations import (
    ConversationBatches,
    encode_conversations,
    read_conversations,
    write_conversations,
)
from scratchlm.chat.rl.stage import rl_config
from scratchlm.chat.sft import sft_config
from scratchlm.chat.tasks import build_tasks, exact_match, fresh_conversations, greedy_reply
from scratchlm.chat.template import ChatTemplate, Message, chat_template, with_chat_tokens
from scratchlm.console import console
from scratchlm.device import plan
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.io import atomic_write
from scratchlm.model.loss import IGNORE, cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.run import RunDirectory, StopReason, load_trained
from scratchlm.training.start import grow_vocabulary
from scratchlm.training.trainer import train


@dataclass(frozen=True)
class ChatSize:
    train_conversations: int
    test_conversations: int
    max_steps: int  # the most steps; the time budget usually ends the run first
    lr: float  # AdamW's peak rate, decayed to a tenth
    rl_steps: int  # the most steps of reinforcement learning (`--rl`)
    rl_lr: float  # its peak rate, decayed to a tenth


# The rate: the best of a sweep on the quickstart's model, 3 minutes of fine-tuning each on two Zen 4 cores
# (exact match on the 200 test conversations): 1e-3 58 %, 2e-3 70.5 %, 4e-3 81.5 %, 8e-3 88.5 %, 1.6e-2 85.5 %.
# The RL rate is a tenth of fine-tuning's (not swept): the policy should move less from a model that answers.
CHAT_FULL = ChatSize(
    train_conversations=20_000, test_conversations=200, max_steps=3000, lr=8e-3, rl_steps=1000, rl_lr=8e-4
)
CHAT_SMALL = ChatSize(
    train_conversations=400, test_conversations=20, max_steps=30, lr=8e-3, rl_steps=4, rl_lr=8e-4
)
# The longest reply RL samples: the built-in tasks' answers are a few words.
RL_REPLY_TOKENS = 32

#: The chat model's run directory, under the quickstart's output directory; the RL model's.
CHAT_RUN = "chat-run"
RL_RUN = "rl-run"
# Questions of the conversation the quickstart shows (the second one follows up on the first).
SHOWN = ("Reverse: print open len", "As a list: zip max", "Add 7 and 5.")


@dataclass(frozen=True)
class ChatResult:
    run_dir: str
    steps: int
    training_seconds: float
    exact_match_before: float
    exact_match_after: float
    loss_before: float
    loss_after: float
    test_conversations: int
    # with --rl: the RL run, its steps and time, and its model's figures
    rl_run_dir: str | None = None
    rl_steps: int | None = None
    rl_training_seconds: float | None = None
    exact_match_rl: float | None = None
    loss_rl: float | None = None


def conversation_files(out_dir: Path, size: ChatSize) -> tuple[Path, Path]:
    """The built-in conversations, written once into `out_dir` (train.jsonl, test.jsonl)."""
    train_file, test_file = out_dir / "train.jsonl", out_dir / "test.jsonl"
    if train_file.exists() and test_file.exists():
        console.print(f"reusing {out_dir}")
        return train_file, test_file
    out_dir.mkdir(parents=True, exist_ok=True)
    train_set, test_set = build_tasks(size.train_conversations, size.test_conversations)
    write_conversations(test_file, test_set)
    write_conversations(train_file, train_set)  # last: its presence says both are whole
    console.print(f"{len(train_set):,} training and {len(test_set):,} test conversations in {out_dir}")
    return train_file, test_file


def fine_tune(
    base: Path, train_file: Path, test_file: Path, run_dir: Path, seconds: float, device: str, size: ChatSize
):
    """Fine-tune `base` (or resume, or reuse the finished run); returns the run's summary."""
    run = RunDirectory(run_dir)
    summary = run.summary()
    if summary is not None and summary.stopped not in (StopReason.INTERRUPTED, StopReason.DIVERGED):
        console.print(f"reusing the finished chat model in {run_dir} (delete it to fine-tune again)")
        return summary
    overrides = {
        "sft.base": str(base),
        "sft.train": str(train_file),
        "sft.valid": str(test_file),
        "logging.run_dir": str(run_dir),
        "training.max_time_s": seconds,
        "training.max_steps": size.max_steps,
        "training.device": device,
        "optimizer.name": "adamw",  # the sweep's (ChatSize), whatever the base's recipe
        "optimizer.lr": size.lr,
        "optimizer.min_lr": size.lr / 10,
    }
    config = sft_config(None, [f"{key}={json.dumps(value)}" for key, value in overrides.items()])
    return train(config, resume=run.latest_checkpoint() is not None)


def prompt_files(out_dir: Path, train_file: Path, test_file: Path, size: ChatSize) -> tuple[Path, Path]:
    """RL prompts (each conversation up to its last question, its last answer the `answer`), written once into
    `out_dir`: rl-train.jsonl, fresh conversations of the built-in tasks whose last questions neither
    `train_file` (which fine-tuning has learnt) nor `test_file` asks, as many as fine-tuning had; rl-test.jsonl,
    the conversations of `test_file`."""
    files = out_dir / "rl-train.jsonl", out_dir / "rl-test.jsonl"
    if all(path.exists() for path in files):
        return files
    test = read_conversations(test_file)
    asked = {messages[-2].content for messages in [*read_conversations(train_file), *test]}
    fresh = fresh_conversations(size.train_conversations, "rl-0", asked)
    for conversations, path in zip((fresh, test), files, strict=True):
        with atomic_write(path, "w") as f:
            for messages in conversations:
                question = [{"role": m.role, "content": m.content} for m in messages[:-1]]
                f.write(json.dumps({"messages": question, "answer": messages[-1].content}) + "\n")
    return files


def reinforce(
    chat_run: Path,
    train_file: Path,
    test_file: Path,
    run_dir: Path,
    seconds: float,
    device: str,
    size: ChatSize,
):
    """Train the chat model by RL on the prompts (or resume, or reuse the finished run); returns its summary."""
    run = RunDirectory(run_dir)
    summary = run.summary()
    if summary is not None and summary.stopped not in (StopReason.INTERRUPTED, StopReason.DIVERGED):
        console.print(f"reusing the finished RL model in {run_dir} (delete it to train again)")
        return summary
    overrides = {
        "rl.base": str(chat_run),
        "rl.train": str(train_file),
        "rl.valid": str(test_file),
        "rl.reward": "exact",
        "rl.max_reply_tokens": RL_REPLY_TOKENS,
        "logging.run_dir": str(run_dir),
        "training.max_time_s": seconds,
        "training.max_steps": size.rl_steps,
        "training.device": device,
        "optimizer.lr": size.rl_lr,
        "optimizer.min_lr": size.rl_lr / 10,
        "eval.batch_size": size.test_conversations,
    }
    config = rl_config(None, [f"{key}={json.dumps(value)}" for key, value in overrides.items()])
    return train(config, resume=run.latest_checkpoint() is not None)


def as_chat_model(source: Path, device: str) -> tuple[TransformerLM, ChatTemplate]:
    """The model of `source` held for inference, and the chat template it is prompted with: its own, or, for
    a base run, scratchlm's, its vocabulary grown as fine-tuning grows it."""
    trained = load_trained(source, device=device)
    template = chat_template(trained.tokenizer)
    model = trained.model
    if template is None:
        tokenizer, _ = with_chat_tokens(trained.tokenizer)
        template = ChatTemplate(tokenizer)
        if tokenizer.vocab_size > model.config.vocab_size:
            config = dataclasses.replace(model.config, vocab_size=tokenizer.vocab_size)
            grown = TransformerLM(config, device=device)
            grown.load_state_dict(grow_vocabulary(model.state_dict(), tokenizer.vocab_size))
            model = grown.eval()
    prepare_for_inference(model, plan(torch.device(device), trained.precision or "auto"))
    return model, template


@torch.no_grad()
def assistant_loss(model: TransformerLM, template: ChatTemplate, conversations: list[list[Message]]) -> float:
    """Mean loss of the assistant's tokens (and their end-of-turn tokens) over `conversations`."""
    encoded = encode_conversations(conversations, template, model.config.context_length)
    batches = ConversationBatches(encoded)
    device = next(model.parameters()).device
    total, counted = 0.0, 0
    for rows in np.array_split(np.arange(len(batches)), max(1, len(batches) // 32)):
        inputs, targets = batches.gather(rows, device)
        n = batches.counted(rows)
        total += cross_entropy(model(inputs), targets, ignore_index=IGNORE).item() * n
        counted += n
    return total / counted


def show_conversation(model: TransformerLM, template: ChatTemplate) -> None:
    """A short conversation, greedy, the history carried from turn to turn."""
    messages: list[Message] = []
    for question in SHOWN:
        messages.append(Message("user", question))
        text = greedy_reply(model, template, messages)
        messages.append(Message("assistant", text))
        # `out`: the text as it is, never read as markup
        console.out(f"user:      {question}")
        console.out(f"assistant: {text}")


def chat_stages(
    base: Path,
    out_dir: Path,
    seconds: float,
    device: str,
    size: ChatSize,
    stage,
    rl_seconds: float | None = None,
) -> ChatResult:
    """The `--chat` stages after the base run, and with `rl_seconds` the `--rl` stage (`stage(title)`
    announces each)."""
    stage("conversations: built-in tasks (copy, reverse, sort, count, add, ...)")
    train_file, test_file = conversation_files(out_dir / "chat", size)
    stage("fine-tuning to chat")
    run_dir = out_dir / CHAT_RUN
    summary = fine_tune(base, train_file, test_file, run_dir, seconds, device, size)
    models = {"base": base, "chat": run_dir}
    rl_summary = None
    if rl_seconds is not None:
        stage("reinforcement learning on the same tasks (exact-match reward)")
        prompts = prompt_files(out_dir / "chat", train_file, test_file, size)
        models["RL"] = out_dir / RL_RUN
        rl_summary = reinforce(run_dir, *prompts, models["RL"], rl_seconds, device, size)
    stage(f"the {', '.join(models)} models on the held-out conversations")
    test_set = read_conversations(test_file)
    scores = {}
    for name, source in models.items():
        model, template = as_chat_model(source, device)
        scores[name] = (exact_match(model, template, test_set), assistant_loss(model, template, test_set))
        console.print(
            f"{name} model: exact match {scores[name][0]:.1%}, assistant-token loss {scores[name][1]:.4f} nats"
        )
    show_conversation(model, template)
    rl = {}
    if rl_summary is not None:
        rl = {
            "rl_run_dir": str(models["RL"]),
            "rl_steps": rl_summary.steps,
            "rl_training_seconds": rl_summary.wall_time_s,
            "exact_match_rl": scores["RL"][0],
            "loss_rl": scores["RL"][1],
        }
    return ChatResult(
        run_dir=str(run_dir),
        steps=summary.steps,
        training_seconds=summary.wall_time_s,
        exact_match_before=scores["base"][0],
        exact_match_after=scores["chat"][0],
        loss_before=scores["base"][1],
        loss_after=scores["chat"][1],
        test_conversations=len(test_set),
        **rl,
    )
