"""Where a run's numbers go: the console, `RUN/metrics.jsonl`, and optionally Weights & Biases / TensorBoard.

Every record is a flat dict with "step", "time" (seconds of training wall-clock, continuing across resumes)
and "tokens", plus either the train fields (train_loss, lr, grad_norm, tokens_per_s, mfu; in fp16 also
loss_scale and skipped_steps, the steps skipped so far for overflowed gradients) or the eval fields
(val_loss, val_ppl). `metrics.jsonl` holds one JSON object per line and is appended to and flushed at every
record, so a crashed run keeps its curve; on resume, records past the checkpoint's step are dropped, because
those steps are about to be trained again.

The MFU (model FLOPs utilisation) estimate divides the model's training FLOPs per second
(`scratchlm.model.accounting.flops_per_token`: 3 × the forward matmuls, about 6·N + 12·L·d·T as in the
PaLM paper's appendix B) by the accelerator's peak.
"""

from __future__ import annotations

import json
from typing import Any

from scratchlm.console import console, progress
from scratchlm.errors import ScratchlmError
from scratchlm.run.directory import RunDirectory
from scratchlm.run.metrics import drop_records_after


class MetricsLogger:
    """Writes records to every configured sink. Only the main process of a run creates one."""

    def __init__(
        self,
        run: RunDirectory,
        config: dict[str, Any],
        total_steps: int | None,
        start_step: int = 0,
        wandb: bool = False,
        wandb_project: str = "scratchlm",
        tensorboard: bool = False,
    ) -> None:
        self.path = run.metrics
        self.total_steps = total_steps
        drop_records_after(self.path, start_step)
        self.file = self.path.open("a", encoding="utf-8")
        self.wandb_run = None
        self.tensorboard = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise ScratchlmError(
                    "logging.wandb = true needs the wandb package: pip install 'scratchlm[wandb]'"
                ) from None
            self.wandb_run = wandb_module.init(
                project=wandb_project, name=run.path.name, dir=str(run.path), config=config, resume="allow"
            )
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ScratchlmError(
                    "logging.tensorboard = true needs the tensorboard package: pip install 'scratchlm[tensorboard]'"
                ) from None
            self.tensorboard = SummaryWriter(log_dir=str(run.path / "tensorboard"))
        self.bar = progress(counter=True, every=None)  # the log lines say how far training has come
        self.bar.start()
        self.task = self.bar.add_task("training", total=total_steps, completed=start_step)

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.tensorboard.add_scalar(key, value, step)
        self.bar.update(self.task, completed=step)
        console.print(_format(record, self.total_steps), highlight=False, markup=True)  # numbers only

    def set_total(self, total_steps: int) -> None:
        """The run's length once it is known (a time budget decides it after measuring the speed)."""
        self.total_steps = total_steps
        self.bar.update(self.task, total=total_steps)

    def note(self, record: dict[str, Any]) -> None:
        """A record for the file only (not printed, not a point of any curve): e.g. a session's setup."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.bar.stop()
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _format(record: dict[str, Any], total_steps: int | None) -> str:
    shown = "?" if total_steps is None else str(total_steps)  # "?": a time budget has yet to decide it
    head = f"step {record['step']:>{len(shown)}}/{shown}"
    if "val_loss" in record:
        return f"{head} │ [bold]val loss {record['val_loss']:.4f}[/] │ val ppl {record['val_ppl']:.2f}"
    if "val_pass1" in record:
        return f"{head} │ [bold]val pass@1 {record['val_pass1']:.1%}[/]"
    # MFU is left out where the device's peak is unknown (CPUs, unless logging.peak_tflops says it).
    mfu = "" if record["mfu"] is None else f" │ mfu {record['mfu']:.1%}"
    norm = "n/a" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"  # n/a: all steps skipped
    # fp16: the loss scale, and the steps skipped so far because their gradients overflowed.
    scaling = (
        f" │ scale {record['loss_scale']:g}, {record['skipped_steps']} skipped"
        if "loss_scale" in record
        else ""
    )
    # reinforcement learning: the mean reward and the reply's length
    rewards = (
        f" │ reward {record['reward']:.3f} │ reply {record['reply_tokens']:.1f} tokens"
        if "reward" in record
        else ""
    )
    return (
        f"{head} │ loss {record['train_loss']:.4f}{rewards} │ lr {record['lr']:.2e} │ grad norm {norm}"
        f" │ {record['tokens_per_s']:,.0f} tok/s{mfu}{scaling}"
    )
