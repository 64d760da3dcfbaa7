"""One optimizer step, and the periodic validation estimate.

At step number t (1-based):

    lr ← schedule(t)   (sized by the time budget when there is one)
    draw `batch_size` rows of the stage's examples: windows of tokens, conversations, replies (the global
    batch; this process takes its slice)
    for each of the `grad_accum` micro-batches:  loss = the stage's loss of its rows × their share of the
        batch's counted targets (1 / grad_accum for windows);  backward
    clip the gradients to norm `grad_clip`;  optimizer step;  zero the gradients
    (a stage whose batch takes several optimizer steps, `Examples.passes`, repeats the last three lines on it)

Every process draws the same window positions from the same generator and keeps its own slice, so the data a
step sees does not depend on how many processes share it: two processes give the same run as one with the
same global batch. How the model runs comes from the device plan: the forward passes under its autocast, the
fused head and loss where it says so, and in fp16 the loss scaled before each backward and the gradients
unscaled before clipping; a step whose gradients overflowed is skipped (`scratchlm.training.loss_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from scratchlm.device import Plan
from scratchlm.errors import DivergedError
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel import Execution
from scratchlm.run.checkpoint import Checkpoint, TrainingState
from scratchlm.run.directory import RunDirectory
from scratchlm.training.budget import TimeBudget
from scratchlm.training.config import TrainConfig
from scratchlm.training.distributed import Distributed, all_reduce
from scratchlm.training.grad import clip_grad_norm
from scratchlm.training.loss_scale import LossScaler
from scratchlm.training.stage import Examples

EVAL_SEED_OFFSET = 1_000_003  # the validation batches come from their own generator: the same ones every time


class TrainStep:
    """The gradients of one step (`gradients`), then its update (`update`): two calls, so that the loop knows
    when the model starts to change (an abort before `update` leaves the previous step intact)."""

    def __init__(
        self,
        config: TrainConfig,
        dist: Distributed,
        device: torch.device,
        model: TransformerLM,
        optimizer: torch.optim.Optimizer,
        execution: Execution,
        choices: Plan,
        scaler: LossScaler,
    ) -> None:
        t = config.training
        self.config, self.dist, self.device = config, dist, device
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.execution = execution
        self.train_model, self.forward_model = execution.train_model, execution.forward_model
        self.autocast, self.fused_loss = choices.autocast(), choices.fused_loss.value
        self.precision = choices.precision.value
        self.context = config.model.context_length
        self.micro_batch = t.batch_size // dist.world_size // t.grad_accum
        self.eval_batch = config.eval.batch_size or t.batch_size

    def gradients(
        self,
        step: int,
        budget: TimeBudget,
        batches: Examples,
        generator: np.random.Generator,
        run: RunDirectory,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The gradients of step `step` (1-based) at the schedule's rate; returns the (device-resident) mean
        loss, the gradient norm before clipping, and whether the update may be applied (fp16 skips a step
        whose gradients overflowed, and a batch whose rows count no target teaches nothing)."""
        t = self.config.training
        lr = budget.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        with self.autocast:  # a stage that samples its rows scores them as its loss will
            drawn = batches.draw(t.batch_size, generator, self.model)
        self.pending = (step, batches, drawn, run)
        return self._backward()

    def _backward(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The gradients of the drawn batch (`gradients`), clipped."""
        step, batches, drawn, run = self.pending
        t = self.config.training
        per_process = t.batch_size // self.dist.world_size
        mine = drawn[self.dist.rank * per_process : (self.dist.rank + 1) * per_process]
        # The loss is the mean over every counted target of the global batch: each micro-batch's mean is
        # weighted by its share of them (1 / grad_accum for windows, where every target counts), times the
        # processes, whose gradients DDP (or FSDP) averages. Rows that count nothing (the replies of a group
        # that teaches nothing) are skipped, which only a stage that runs in one process has.
        total = batches.counted(drawn)
        loss_sum = torch.zeros((), device=self.device)
        if not total:
            return loss_sum, torch.zeros((), device=self.device), False
        for k in range(t.grad_accum):
            batch = mine[k * self.micro_batch : (k + 1) * self.micro_batch]
            counted = batches.counted(batch)
            if not counted:
                continue
            divisor = total / (counted * self.dist.world_size)
            with self.execution.gradient_sync(last=k == t.grad_accum - 1):
                with self.autocast:
                    loss = batches.loss(batch, self.train_model, self.device, self.fused_loss) / divisor
                self.scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.model.parameters())
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.optimizer.grad_clip or math.inf)
        applied = self.scaler.update(grad_norm)
        if self.scaler.collapsed:
            kept = run.latest_checkpoint()
            raise DivergedError("gradient norm", step, str(kept) if kept else None)
        return loss_sum, grad_norm, applied

    def update(self, applied: bool) -> None:
        """Apply the gradients of `gradients` (if `applied`), then take the batch's further passes, each
        gradients and update (reinforcement learning's `rl.epochs_per_batch`)."""
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for _ in range(1, self.pending[1].passes):
            _, _, applied = self._backward()
            if applied:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def checkpoint(
        self, step: int, data_rng: dict[str, Any], elapsed_s: float, budget: TimeBudget, whole: bool = True
    ) -> Checkpoint:
        """Everything that continues the run exactly after `step` steps (`data_rng`: the sampling generator's
        state after them); without the model's and optimizer's state unless `whole`."""
        cuda = self.device.type == "cuda"
        training = TrainingState(
            config=self.config.to_dict(),
            data_rng=data_rng,
            torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state(self.device) if cuda else None,
            elapsed_s=elapsed_s,
            tokens=step * self.config.training.batch_size * self.context,
            precision=self.precision,
            time_budget=None if budget.decision is None else budget.decision.to_dict(),
            loss_scale=self.scaler.state_dict() if self.scaler.enabled else None,
            world_size=self.dist.world_size,
        )
        if not whole:  # the model and optimizer go into shards (scratchlm.run.sharded): the rest is here
            return Checkpoint({}, step, self.model.config, training=training)
        return Checkpoint.of(self.model, step, optimizer=self.optimizer.state_dict(), training=training)

    @torch.no_grad()
    def validation_loss(self, batches: Examples) -> float:
        """Mean loss over the counted targets of the validation batches (`eval.iters` of them, the same ones
        every time). Each process takes its share of every batch and runs it in chunks of the training
        micro-batch (which fits in memory). Under FSDP every forward pass gathers parameters with all the
        processes, so each runs as many as the one with the largest share, the surplus ones on a row it does
        not count."""
        self.model.eval()
        seed = self.config.training.seed + EVAL_SEED_OFFSET
        total, counted = torch.zeros((), device=self.device), 0
        lockstep = self.execution.lockstep
        for indices in batches.validation_batches(self.config.eval.iters, self.eval_batch, seed):
            counted += batches.counted(indices)
            mine = np.array_split(indices, self.dist.world_size)[self.dist.rank]
            largest = math.ceil(len(indices) / self.dist.world_size)
            for chunk in np.array_split(mine, max(1, math.ceil(largest / self.micro_batch))):
                if len(chunk) or lockstep:
                    rows = chunk if len(chunk) else indices[:1]
                    with self.autocast:
                        loss = batches.loss(rows, self.forward_model, self.device, fused=False)
                    if len(chunk):
                        total += loss * batches.counted(chunk)
        self.model.train()
        return all_reduce(total, "sum").item() / counted
