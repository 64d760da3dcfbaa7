"""Training data: random windows of a long token array, and the checks a token file must pass.

A dataset is one flat array of token ids (the documents concatenated, separated by `<|endoftext|>`), stored
as `.npy` and memory-mapped, so a file larger than memory costs nothing to open and a batch reads only the
pages it touches. A training example is a window of `context_length + 1` consecutive ids starting at a
uniformly random position `s ∈ {0, …, len - context_length - 1}` (every valid start): the first
`context_length` ids are the inputs and the same window shifted by one are the targets.

Sampling takes an explicit `numpy.random.Generator`, so that the trainer can save and restore the sampling
state with its checkpoints (an exact resume), and give every data-parallel rank its own slice of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from scratchlm.console import progress
from scratchlm.errors import ScratchlmError
from scratchlm.model.loss import cross_entropy

VALIDATION_CHUNK = 1 << 24  # ids checked per step when validating a file: 32 MiB of uint16 at a time


def sample_starts(
    num_tokens: int, batch_size: int, context_length: int, generator: np.random.Generator | None = None
) -> np.ndarray:
    """`batch_size` start positions, uniform over `0 ..= num_tokens - context_length - 1`."""
    num_starts = num_tokens - context_length
    if num_starts < 1:
        raise ScratchlmError(
            f"a dataset of {num_tokens} tokens is too short for context_length {context_length}: "
            f"it needs at least {context_length + 1}"
        )
    if generator is None:  # the global NumPy state, so `np.random.seed` makes a plain call reproducible
        return np.random.randint(0, num_starts, size=batch_size)
    return generator.integers(0, num_starts, size=batch_size)


def gather_batch(
    dataset: np.ndarray, starts: np.ndarray, context_length: int, device: str | torch.device
) -> tuple[Int[Tensor, "batch context"], Int[Tensor, "batch context"]]:
    """The windows at `starts` as (inputs, targets) int64 tensors on `device`."""
    windows = dataset[starts[:, None] + np.arange(context_length + 1)]  # one fancy-index read per batch
    device = torch.device(device)

    def to_device(ids: np.ndarray) -> Tensor:
        tensor = torch.from_numpy(ids.astype(np.int64))  # a contiguous int64 copy
        if device.type == "cuda":  # pinned memory lets the copy overlap with the GPU's work
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    return to_device(windows[:, :-1]), to_device(windows[:, 1:])


def get_batch(
    dataset: np.ndarray,
    batch_size: int,
    context_length: int,
    device: str | torch.device,
    generator: np.random.Generator | None = None,
) -> tuple[Int[Tensor, "batch context"], Int[Tensor, "batch context"]]:
    """Sample `batch_size` windows of `dataset`: (inputs, targets), targets shifted by one, on `device`.

    An invalid device raises (torch's own error), it is never silently replaced.
    """
    starts = sample_starts(len(dataset), batch_size, context_length, generator)
    return gather_batch(dataset, starts, context_length, device)


class TokenWindows:
    """Pretraining batches: windows of `context_length + 1` tokens at uniform random starts of `tokens`, every
    target counted, the loss their cross-entropy. (`scratchlm.chat.conversations.ConversationBatches` is the
    fine-tuning counterpart: the training step reads either as `scratchlm.training.stage.Examples`.)"""

    def __init__(self, tokens: np.ndarray, context_length: int) -> None:
        self.tokens, self.context_length = tokens, context_length
        self.tokens_per_row = context_length  # the inputs of a row
        self.passes = 1  # one optimizer step a batch

    def __len__(self) -> int:
        return len(self.tokens)

    def draw(self, batch_size: int, generator: np.random.Generator, policy: object = None) -> np.ndarray:
        return sample_starts(len(self.tokens), batch_size, self.context_length, generator)

    def counted(self, starts: np.ndarray) -> int:
        return len(starts) * self.context_length

    def gather(
        self, starts: np.ndarray, device: str | torch.device
    ) -> tuple[Int[Tensor, "batch context"], Int[Tensor, "batch context"]]:
        return gather_batch(self.tokens, starts, self.context_length, device)

    def loss(
        self, starts: np.ndarray, model: Callable[..., Tensor], device: torch.device, fused: bool
    ) -> Float[Tensor, ""]:
        """The mean cross-entropy of every target of the windows at `starts`; `fused`: the model computes
        the head and the loss together, over chunks of tokens."""
        inputs, targets = self.gather(starts, device)
        return model(inputs, targets=targets) if fused else cross_entropy(model(inputs), targets)

    def validation_batches(self, iters: int, batch_size: int, seed: int) -> list[np.ndarray]:
        """`iters` batches of windows drawn from their own generator: the same ones at every estimate."""
        generator = np.random.default_rng(seed)
        return [self.draw(batch_size, generator) for _ in range(iters)]


NPY_MAGIC = b"\x93NUMPY"  # how every .npy file starts


def load_tokens(path: str | Path, vocab_size: int, context_length: int) -> np.ndarray:
    """Memory-map a `.npy` token file and check it: 1-D integers, every id < `vocab_size`, long enough."""
    path = Path(path)
    if not path.is_file():
        raise ScratchlmError(f"token file {path} not found")
    with path.open("rb") as f:
        start = f.read(len(NPY_MAGIC))
    if start != NPY_MAGIC:  # text, most often: numpy would answer about pickled data
        what = "an empty file" if not start else "not a .npy file"
        raise ScratchlmError(
            f"token file {path} is {what}; expected the .npy token ids that `scratchlm encode` or "
            "`scratchlm prepare` make from text"
        )
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ScratchlmError(f"token file {path} is not a readable .npy array: {e}") from None
    if tokens.dtype.kind not in "ui":
        raise ScratchlmError(
            f"token file {path} holds {tokens.dtype} values; expected integer token ids (uint16 or uint32)"
        )
    if tokens.ndim != 1:
        raise ScratchlmError(f"token file {path} has shape {tokens.shape}; expected a 1-D array of token ids")
    if len(tokens) == 0:
        raise ScratchlmError(f"token file {path} holds no tokens (was its text empty?)")
    if len(tokens) < context_length + 1:
        raise ScratchlmError(
            f"token file {path} has {len(tokens)} tokens; context_length {context_length} needs at least "
            f"{context_length + 1}"
        )
    with progress(transient=True) as bar:
        task = bar.add_task(
            f"checking {path.name}", total=len(tokens), visible=len(tokens) > 50 * VALIDATION_CHUNK
        )
        for begin in range(0, len(tokens), VALIDATION_CHUNK):
            chunk = tokens[begin : begin + VALIDATION_CHUNK]
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                where = begin + int(np.argmax(chunk == bad))
                raise ScratchlmError(
                    f"token file {path} has id {bad} at position {where}; the model's vocabulary is 0..{vocab_size - 1}"
                )
            bar.advance(task, len(chunk))
    return tokens
