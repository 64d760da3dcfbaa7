"""A batch of replies as the rows the loss sees: each prompt followed by its reply, right-padded, with the targets
shifted by one and a mask over the targets that are the reply's (`pack`), held with what the loss weighs them by
(`Rollouts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


@dataclass(frozen=True)
class Rollouts:
    """The replies of a batch that its loss sees, one a row: `inputs` and `targets` (the prompt and reply, shifted
    by one), `mask` (the targets that are the reply's), each row's advantage, and whether its group teaches
    (`counted`). The replies' token log-probabilities under the sampling policy (`old_logprobs`: None when the
    batch takes one optimizer step, whose policy is the sampling one) and under the starting model
    (`ref_logprobs`: None without a KL penalty). Sliced by row for the micro-batches."""

    inputs: Int[Tensor, "rows seq"]
    targets: Int[Tensor, "rows seq"]
    mask: Bool[Tensor, "rows seq"]
    advantages: Float[Tensor, " rows"]
    counted: Bool[Tensor, " rows"]
    old_logprobs: Float[Tensor, "rows seq"] | None = None
    ref_logprobs: Float[Tensor, "rows seq"] | None = None

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, rows: slice) -> Rollouts:
        return Rollouts(
            *(None if value is None else value[rows] for value in vars(self).values())  # in field order
        )


def pack(
    prompts: list[list[int]], replies: list[list[int]], device: torch.device
) -> tuple[Int[Tensor, "rows seq"], Int[Tensor, "rows seq"], Bool[Tensor, "rows seq"]]:
    """The inputs, targets and reply mask of each prompt followed by its reply, right-padded to the longest."""
    rows = [prompt + reply for prompt, reply in zip(prompts, replies, strict=True)]
    width = max(len(row) for row in rows) - 1
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for k, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        inputs[k, : len(row) - 1] = torch.tensor(row[:-1])
        targets[k, : len(row) - 1] = torch.tensor(row[1:])
        mask[k, len(prompt) - 1 : len(row) - 1] = True
    return inputs.to(device), targets.to(device), mask.to(device)
