"""What a training session measures of itself, at its log steps and its evaluation steps, handed to the
reporting (`scratchlm.training.report.Reporter`).

At a log step: the interval's tokens/s, the MFU against the device's peak, the learning rate, the gradient
norm, fp16's loss scale and skipped steps, the stage's own metrics; the thread count is tuned there too, since
that is when a step's speed is known. At an evaluation step: the loss of the validation batches, or the stage's
own measure of its validation (`Stage.evaluate`). The loop (`scratchlm.training.trainer`) decides when.
"""

from __future__ import annotations

from scratchlm.device import Plan
from scratchlm.device.choices import ThreadTuner
from scratchlm.model.accounting import flops_per_token
from scratchlm.model.transformer import TransformerLM
from scratchlm.training.config import TrainConfig
from scratchlm.training.distributed import Distributed
from scratchlm.training.report import Interval, Reporter
from scratchlm.training.stage import Stage, TrainingData
from scratchlm.training.step import TrainStep


class Monitor:
    """The measurements of one session; `last_eval` and `final_val_loss` say what the last evaluation was."""

    def __init__(
        self,
        config: TrainConfig,
        dist: Distributed,
        choices: Plan,
        stage: Stage,
        data: TrainingData,
        model: TransformerLM,
        stepper: TrainStep,
        report: Reporter,
    ) -> None:
        self.config, self.dist, self.choices, self.stage, self.data = config, dist, choices, stage, data
        self.model, self.stepper, self.report = model, stepper, report
        self.threads = ThreadTuner(choices.threads, compiled=choices.compile.value)
        self.last_eval: int | None = None  # the step of the last evaluation
        self.final_val_loss: float | None = None

    def log_train(
        self, step: int, elapsed: float, interval: Interval, loss: float, grad_norm: float | None
    ) -> None:
        """Log the interval that ends at `step` (`elapsed` seconds into the run), and start the next."""
        tokens_per_s = interval.close(self.report.tokens_per_step)
        if (change := self.threads.update()) is not None:
            self.report.note(change)
        peak = self.choices.peak_flops.value
        flops = tokens_per_s * flops_per_token(self.config.model)
        scaler = self.stepper.scaler
        self.report.train(
            step,
            elapsed,
            train_loss=loss,
            lr=self.stepper.optimizer.param_groups[0]["lr"],
            grad_norm=grad_norm,
            tokens_per_s=tokens_per_s,
            mfu=flops / (peak * self.dist.world_size) if peak else None,
            # fp16: the scale, and the steps skipped so far for overflowed gradients
            loss_scale=scaler.scale if scaler.enabled else None,
            skipped_steps=scaler.skipped if scaler.enabled else None,
            **(self.stage.train_metrics(self.data.train) if self.stage.train_metrics else {}),
        )

    def evaluate(self, step: int, elapsed: float) -> None:
        """The stage's validation at `step`: the loss of the validation batches, or the stage's own measure."""
        self.last_eval = step
        if (evaluate := self.stage.evaluate) is not None:
            self.report.evaluation(step, elapsed, None, **evaluate(self.data.valid, self.model))
            return
        self.final_val_loss = self.stepper.validation_loss(self.data.valid)
        self.report.evaluation(step, elapsed, self.final_val_loss)
