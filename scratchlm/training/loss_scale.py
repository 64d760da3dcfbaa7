"""Dynamic loss scaling, which fp16 training needs and bf16 and fp32 do not.

fp16 keeps 5 exponent bits: its smallest normal number is 6.1e-5, and gradients of activations are often
smaller, so under fp16 autocast they flush to zero and the model stops learning. Multiplying the loss by a
scale `s` multiplies every gradient of the backward pass by `s` (the chain rule is linear), lifting them into
fp16's range; the float32 gradients of the master weights are then divided by `s` before anything reads them
(Micikevicius et al., 2018, "Mixed Precision Training"). The right `s` is not known in advance, so it is
found as training goes:

    scale the loss by s; backward
    unscale: g ← g / s
    if any gradient is inf or NaN (the scaled backward overflowed): skip the update, s ← s · backoff (½)
    else: clip, update, and after `growth_interval` clean steps in a row s ← s · growth (2)

A skipped step consumes its batch and its place in the learning-rate schedule, like PyTorch's GradScaler with
a scheduler. The scale, the count of clean steps and the steps skipped so far go into every checkpoint, so a
resumed run continues with the same scale and stays bit-exact. With a scale below `MIN_SCALE` the gradients
overflow even unscaled: the run has diverged.

`LossScaler(enabled=False)` (every precision but fp16) multiplies by nothing and skips nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from scratchlm.training.distributed import local

INIT_SCALE = 2.0**16
GROWTH, BACKOFF = 2.0, 0.5
GROWTH_INTERVAL = 2000  # clean steps before the scale doubles (PyTorch's GradScaler default)
MIN_SCALE = 1.0


class LossScaler:
    def __init__(self, enabled: bool, scale: float | None = None, growth_interval: int | None = None) -> None:
        self.enabled = enabled
        self.scale = (scale or INIT_SCALE) if enabled else 1.0
        self.growth_interval = growth_interval or GROWTH_INTERVAL
        self.clean_steps = 0  # consecutive steps applied since the scale last changed
        self.skipped = 0  # steps skipped over the whole run

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by the scale, in place (before clipping reads the gradient norm)."""
        if not self.enabled:
            return
        grads = [local(p.grad) for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grad_norm: Tensor) -> bool:
        """After unscaling and measuring the gradient norm: whether the step may be applied, with the scale
        adjusted for the next one. A non-finite norm is an overflow: the step is skipped. The norm is the
        global one (`clip_grad_norm`: all-reduced under sharding), so every process decides alike."""
        if not self.enabled:
            return True
        if not torch.isfinite(grad_norm):
            self.scale *= BACKOFF
            self.clean_steps = 0
            self.skipped += 1
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= GROWTH
            self.clean_steps = 0
        return True

    @property
    def collapsed(self) -> bool:
        """The scale has fallen below `MIN_SCALE`: gradients overflow even without scaling."""
        return self.enabled and self.scale < MIN_SCALE

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])
