"""Reinforcement learning with verifiable rewards: a chat run taught to get answers right, with the training
loop underneath.

    chat run (sft, or any run whose tokenizer carries a chat template) + prompts with answers (JSONL)
      -> each step: `training.batch_size / rl.group_size` prompts drawn, `rl.group_size` replies sampled to
         each by the batched decoding engine (`rollouts`), each scored by the reward (`rewards`)
      -> packed into rows (`packing`); the replies' tokens under the sampling policy (only where
         `rl.epochs_per_batch` > 1) and the starting model (only where `rl.kl_coef` > 0)
      -> `rl.epochs_per_batch` optimizer steps on the clipped policy-gradient loss (`objective`), the rows of
         groups whose rewards were all equal left out

An RL run is a training run whose stage is `RL` (its config's `[rl]` section, registered here): the same run
directory, metrics (the reward, the share of uniform groups, KL, clip fraction, reply length and entropy per
log record; the held-out prompts' greedy pass@1 at each evaluation), plots, checkpoints, time budget and exact
resume: the prompts and the replies' seeds are drawn from the generator the checkpoints keep. Its `[model]` and
tokenizer are the base's and `training.init_from` is the base; `training.batch_size` counts replies. The result
is a chat run like the base: `chat`, `serve`, `export` and `eval` read it unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from scratchlm.chat.rl.objective import (
    LengthNorm,
    group_advantages,
    kl_estimate,
    policy_loss,
    teaching_mean,
    token_entropy,
    token_logprobs,
    uniform_groups,
)
from scratchlm.chat.rl.packing import Rollouts, pack
from scratchlm.chat.rl.prompts import Prompt, read_prompts
from scratchlm.chat.rl.rewards import Reward, load_reward, score
from scratchlm.chat.rl.rollouts import sample_replies
from scratchlm.chat.sft import held_out_split
from scratchlm.chat.template import ChatTemplate, JinjaChatTemplate, chat_template
from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import default_lora_targets
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import load_trained
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.config import TrainConfig
from scratchlm.training.config_reader import given_keys, read_toml
from scratchlm.training.stage import Stage, TrainingData, check_run_tokenizer, register_stage

# What reinforcement learning changes from pretraining's defaults: AdamW at a low rate and no weight decay (the
# policy should move a little from a model that already chats), 4 prompts × 8 replies a step, the held-out
# prompts' pass@1 every 20 steps.
RL_DEFAULTS: dict[str, dict] = {
    "optimizer": {"name": "adamw", "lr": 1e-4, "min_lr": 1e-5, "weight_decay": 0.0, "grad_clip": 1.0},
    "schedule": {"kind": "cosine", "warmup_iters": 0},
    "training": {"batch_size": 32, "max_steps": 200},
    "eval": {"interval": 20, "iters": 1, "batch_size": 64},
    "checkpoint": {"interval": 50},
    "logging": {"run_dir": "runs/rl", "log_interval": 1},
}


@dataclass(frozen=True)
class RLConfig:
    base: str = ""  # the chat run trained: its model and tokenizer with its chat template
    train: str = ""  # prompts, JSONL: {"messages": [... up to the question], "answer": "..."}; required
    valid: str = ""  # held-out prompts; "": valid_fraction of train's, the same ones every time
    valid_fraction: float = 0.05
    # exact | contains | number | regex, or module:function (a module, or a .py file), called as
    # function(reply, answer, messages) -> float (scratchlm.chat.rl.rewards)
    reward: str = "exact"
    reward_timeout_s: float = 10.0  # a reward that runs longer on one reply stops the run
    group_size: int = 8  # replies sampled to each prompt (training.batch_size counts replies)
    temperature: float = 1.0  # of the sampled replies, above 0 (validation decodes greedily)
    max_reply_tokens: int = 64  # at most, and at most what the context leaves after the prompt
    normalize_std: bool = False  # divide each advantage by its group's std (GRPO) or not (Dr. GRPO)
    # "constant": a reply's token terms summed over max_reply_tokens (Dr. GRPO); "sequence": averaged over
    # its length (GRPO). docs/rl.md says why it matters
    length_norm: LengthNorm = "constant"
    clip_eps: float = 0.2  # the importance ratio's clip: [1 - clip_eps, 1 + clip_eps]
    epochs_per_batch: int = 1  # optimizer steps on each batch of replies
    kl_coef: float = 0.0  # weight of the KL penalty to the starting model (0: measured, not penalised)

    def check(self, source: str) -> None:
        """Checks across keys."""
        if not self.train:
            raise ScratchlmError(f"{source}: rl.train is required: the prompts with their answers (JSONL)")
        if not self.base:
            raise ScratchlmError(f"{source}: rl.base is required (the chat run to train)")
        if not 0 < self.valid_fraction < 1:
            raise ScratchlmError(
                f"{source}: rl.valid_fraction must lie in (0, 1), got {self.valid_fraction!r}"
            )
        for key in ("max_reply_tokens", "epochs_per_batch"):
            if getattr(self, key) < 1:
                raise ScratchlmError(f"{source}: rl.{key} must be at least 1, got {getattr(self, key)!r}")
        if self.group_size < 2:
            raise ScratchlmError(f"{source}: rl.group_size must be at least 2: a group is its own baseline")
        if not self.temperature > 0:
            raise ScratchlmError(
                f"{source}: rl.temperature must be above 0, got {self.temperature!r}: greedy replies to a prompt "
                "are one reply repeated, a group that teaches nothing"
            )
        for key in ("kl_coef", "reward_timeout_s"):
            if not getattr(self, key) >= 0:
                raise ScratchlmError(f"{source}: rl.{key} must be >= 0, got {getattr(self, key)!r}")
        if not 0 < self.clip_eps < 1:
            raise ScratchlmError(f"{source}: rl.clip_eps must lie in (0, 1), got {self.clip_eps!r}")


def rl_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    flags: dict[str, tuple[str, Any]] | None = None,
) -> TrainConfig:
    """The RL config: `RL_DEFAULTS`, the file at `path`, a command's `flags` (`TrainConfig.load`), the
    `overrides`, then the base's model and `training.init_from = rl.base`."""
    if path is not None and "model" in read_toml(Path(path)):
        raise ScratchlmError(f"{path}: an RL config has no [model]: the model is rl.base's")
    if any(o.strip().startswith("model.") for o in overrides):
        raise ScratchlmError("--set model.*: an RL run's model is rl.base's")
    config = TrainConfig.load(path, overrides, defaults=RL_DEFAULTS, flags=flags, stage="rl")
    source = str(path) if path is not None else "rl config"
    if config.training.batch_size % config.rl.group_size:
        raise ScratchlmError(
            f"{source}: training.batch_size ({config.training.batch_size}) counts replies: it must be a "
            f"multiple of rl.group_size ({config.rl.group_size})"
        )
    base_model, _ = _base(config.rl.base)
    values = config.to_dict()
    values["model"] = base_model.to_dict()
    values["training"]["init_from"] = config.rl.base
    if "lora.targets" not in given_keys(path, overrides, flags):
        values["lora"]["targets"] = list(default_lora_targets(base_model))
    return TrainConfig.from_dict(values, source)


def _base(base: str) -> tuple[Any, Tokenizer]:
    """The base's model config and its tokenizer, which must carry a chat template."""
    if not Path(base).exists():  # named as the command's flag and the config's key, which both set it
        raise ScratchlmError(
            f"--base (rl.base) {base}: not found: expected a chat run directory or checkpoint"
        )
    trained = load_trained(base, "cpu")
    if trained.tokenizer is None or chat_template(trained.tokenizer) is None:
        raise ScratchlmError(
            f"rl.base {base} is not a chat model (its tokenizer has no chat template): fine-tune it first "
            "(`scratchlm sft`)"
        )
    return trained.model.config, trained.tokenizer


class PromptSet:
    """The stage's `scratchlm.training.stage.Examples`: prompts drawn uniformly with replacement, a group of
    replies sampled to each (`draw`), their loss the clipped policy-gradient objective (`loss`); and the
    held-out prompts' greedy pass@1 (`pass_at_1`), the stage's validation instead of a loss (so it has no
    `validation_batches`)."""

    def __init__(
        self,
        prompts: list[Prompt],
        template: ChatTemplate | JinjaChatTemplate,
        tokenizer: Tokenizer,
        settings: RLConfig,
        reward: Reward,
        context_length: int,
        evaluated: int,
    ) -> None:
        """`evaluated`: how many of the prompts (the first) a validation decodes. A prompt that leaves no room
        for a reply in the context is skipped (`skipped` counts them)."""
        encoded = [(prompt, template.encode(prompt.messages)) for prompt in prompts]
        kept = [(prompt, ids) for prompt, ids in encoded if len(ids) < context_length]
        if not kept:
            raise ScratchlmError(
                f"{prompts[0].where}: every prompt of the file is at least the context ({context_length} tokens) "
                "long, which leaves no room for a reply"
            )
        self.prompts, self.ids = [prompt for prompt, _ in kept], [ids for _, ids in kept]
        self.skipped = len(prompts) - len(kept)
        self.template, self.tokenizer, self.settings = template, tokenizer, settings
        self.reward, self.evaluated = reward, min(evaluated, len(self.prompts))
        self.tokens_per_row = float(np.mean([len(ids) for ids in self.ids])) + settings.max_reply_tokens
        self.passes = settings.epochs_per_batch
        self.reference: TransformerLM | None = None  # the starting model, for the KL (loaded once)
        self.batch_stats: list[dict[str, float]] = []  # of the batches drawn since the last `metrics`
        self.clip_stats: list[
            tuple[int, int]
        ] = []  # (clipped, counted) reply tokens of the losses since then
        # Summed over the reply tokens of the batches since then, at the policy that sampled them: the entropy,
        # the KL to the starting model (with a penalty only), and the tokens.
        self.measured: dict[str, Tensor] = {}
        self.unmeasured = 0  # rows of the last batch whose first loss pass is still to come

    def __len__(self) -> int:
        return len(self.prompts)

    def _replies(
        self, model: TransformerLM, indices: np.ndarray, temperature: float, seeds: list[int] | None
    ) -> list[list[int]]:
        ids = [self.ids[i] for i in indices]
        stop_ids = self.template.stop_ids
        eos = self.tokenizer.eos_id
        return sample_replies(model, ids, self.settings.max_reply_tokens, temperature, seeds, eos, stop_ids)

    def _rewards(self, indices: np.ndarray, replies: list[list[int]]) -> list[float]:
        rewards = []
        for i, reply in zip(indices, replies, strict=True):
            prompt = self.prompts[i]
            text = self.tokenizer.decode([t for t in reply if t not in self.template.stop_ids])
            rewards.append(
                score(self.reward, self.settings.reward, text, prompt.answer, prompt.messages, prompt.where,
                      self.settings.reward_timeout_s)
            )  # fmt: skip
        return rewards

    def draw(self, batch_size: int, generator: np.random.Generator, policy: TransformerLM) -> Rollouts:
        """`batch_size / group_size` prompts and `group_size` replies to each, sampled by `policy` and scored;
        the replies of the groups that teach (whose rewards differ) with their advantages and
        log-probabilities. The others would only be multiplied by zero: leaving them out before any forward
        pass saves the passes on them (about half the replies of a model that already answers well). When no
        group teaches, every reply is kept, counted by no loss, so that the KL and entropy are still measured."""
        s = self.settings
        chosen = generator.integers(0, len(self.prompts), size=batch_size // s.group_size)
        seeds = generator.integers(0, np.iinfo(np.int64).max, size=batch_size).tolist()
        indices = np.repeat(chosen, s.group_size)
        replies = self._replies(policy, indices, s.temperature, seeds)
        rewards = torch.tensor(self._rewards(indices, replies)).view(-1, s.group_size)
        uniform = uniform_groups(rewards)
        teaching = (~uniform).repeat_interleave(s.group_size)
        kept = teaching.nonzero()[:, 0].tolist() if teaching.any() else list(range(batch_size))
        device = next(policy.parameters()).device
        inputs, targets, mask = pack([self.ids[indices[r]] for r in kept], [replies[r] for r in kept], device)
        # The loss's first pass is at the sampling policy: its log-probabilities are π_old's where the batch takes
        # one step, and it measures the entropy and KL. Only a second step needs π_old's kept from a pass here,
        # and only a KL penalty the starting model's.
        old_logprobs = ref_logprobs = None
        with torch.no_grad():
            if self.passes > 1:
                old_logprobs = token_logprobs(policy(inputs), targets)
            if s.kl_coef > 0:
                if self.reference is None:
                    self.reference = load_trained(s.base, device).model
                ref_logprobs = token_logprobs(self.reference(inputs), targets)
        advantages = group_advantages(rewards, s.normalize_std).flatten()[kept].to(device)
        self.batch_stats.append(
            {
                "reward": rewards.mean().item(),
                "uniform_groups": uniform.float().mean().item(),
                "reply_tokens": float(np.mean([len(reply) for reply in replies])),
            }
        )
        rollouts = Rollouts(
            inputs, targets, mask, advantages, teaching[kept].to(device), old_logprobs, ref_logprobs
        )
        self.unmeasured = len(rollouts)
        if not teaching.any():  # no loss pass will come: measure with a pass of its own
            with torch.no_grad():
                logits = policy(inputs)
                self._measure(rollouts, logits, token_logprobs(logits, targets))
        return rollouts

    def _measure(self, rows: Rollouts, logits: Float[Tensor, "rows seq vocab"], logprobs: Tensor) -> None:
        """Add the entropy and (with a reference) the KL over the reply tokens of `rows` to `measured`."""
        self.unmeasured -= len(rows)
        sums = {"entropy": (token_entropy(logits) * rows.mask).sum(), "tokens": rows.mask.sum()}
        if rows.ref_logprobs is not None:
            sums["kl"] = (kl_estimate(logprobs.detach(), rows.ref_logprobs) * rows.mask).sum()
        for key, value in sums.items():
            self.measured[key] = self.measured.get(key, 0) + value.detach()

    def counted(self, rows: Rollouts) -> int:
        """The replies the loss counts: those of groups whose rewards differ."""
        return int(rows.counted.sum())

    def loss(self, rows: Rollouts, model: Any, device: torch.device, fused: bool) -> Float[Tensor, ""]:
        """The mean over the counted replies of `rows` of their clipped policy-gradient loss (never `fused`:
        the loss needs each token's log-probability)."""
        s = self.settings
        logits = model(rows.inputs)
        logprobs = token_logprobs(logits, rows.targets)
        if self.unmeasured > 0:
            self._measure(rows, logits, logprobs)
        old_logprobs = logprobs.detach() if rows.old_logprobs is None else rows.old_logprobs
        result = policy_loss(
            logprobs, old_logprobs, rows.advantages, rows.mask, s.clip_eps, s.length_norm,
            s.max_reply_tokens, rows.ref_logprobs, s.kl_coef,
        )  # fmt: skip
        tokens = rows.mask & rows.counted[:, None]
        self.clip_stats.append(((result.clipped & tokens).sum().item(), tokens.sum().item()))
        return teaching_mean(result.per_row, rows.counted)

    def metrics(self) -> dict[str, float]:
        """The `TrainRecord` fields of the batches since the last call: means of the reward, the share of
        uniform groups, the reply length, the KL to the starting model and the entropy per reply token; the share
        of the counted reply tokens the clip cut, over every pass."""
        batches, clips, measured = self.batch_stats, self.clip_stats, self.measured
        self.batch_stats, self.clip_stats, self.measured = [], [], {}
        if not batches:
            return {}
        values = {key: float(np.mean([b[key] for b in batches])) for key in batches[0]}
        tokens = measured.pop("tokens").item() if measured else 0
        values.update({key: total.item() / tokens for key, total in measured.items() if tokens})
        counted = sum(tokens for _, tokens in clips)
        values["clip_fraction"] = sum(clipped for clipped, _ in clips) / counted if counted else 0.0
        return values

    def pass_at_1(self, model: TransformerLM) -> float:
        """The share of the held-out prompts (the first `evaluated`) whose greedy reply gets the full reward
        (at least 1)."""
        indices = np.arange(self.evaluated)
        replies = self._replies(model, indices, 0.0, None)
        return float(np.mean([reward >= 1 for reward in self._rewards(indices, replies)]))


def load_prompts(config: TrainConfig, run_dir: RunDirectory) -> TrainingData:
    """The training and held-out prompts of `[rl]`, encoded with the base's chat template, and its tokenizer,
    which a resumed run must not have changed."""
    s = config.rl
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ScratchlmError("scratchlm rl runs in one process: start it without torchrun")
    reward = load_reward(s.reward)
    train = read_prompts(s.train)
    if s.valid:
        valid = read_prompts(s.valid)
    else:
        train, valid = held_out_split(train, s.valid_fraction, f"{s.train}: one prompt")
    _, tokenizer = _base(s.base)
    template = chat_template(tokenizer)
    evaluated = config.eval.iters * (config.eval.batch_size or config.training.batch_size)
    context = config.model.context_length
    sets = [PromptSet(p, template, tokenizer, s, reward, context, evaluated) for p in (train, valid)]
    console.print(
        f"{len(sets[0]):,} training prompts, {len(sets[1]):,} held out ({sets[1].evaluated:,} evaluated); "
        f"{s.group_size} replies to each, reward {s.reward}"
    )
    if skipped := sets[0].skipped + sets[1].skipped:
        console.print(
            f"{skipped:,} prompts skipped: they leave no room for a reply in the context ({context} tokens)"
        )
    check_run_tokenizer(tokenizer, f"the tokenizer of rl.base {s.base}", run_dir)
    return TrainingData(sets[0], sets[1], tokenizer)


RL = register_stage(
    Stage(
        "rl",
        RLConfig,
        load_prompts,
        evaluate=lambda valid, model: {"val_pass1": valid.pass_at_1(model)},
        train_metrics=lambda train: train.metrics(),
    )
)
