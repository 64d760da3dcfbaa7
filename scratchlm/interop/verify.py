"""The check every export passes before it is declared a success: an independent implementation, loading what
was written, computes the same logits as scratchlm on a fixed input.

The independent implementation is transformers (its Llama/Qwen3 code for the HF directory, or the directory's
own modeling code, a separate implementation of scratchlm's model in transformers' terms; and its GGUF reader,
which undoes llama.cpp's layout itself, for a GGUF file). The reference is the scratchlm model with
its weights rounded as the file stores them (float16 or bfloat16 weights are compared with a model that has
those weights, computing in float32 on both sides), so the comparison tests the conversion, not the
precision. A layout mistake (a missing permutation, a transposed matrix, a wrong epsilon or theta) moves the
logits by far more than the tolerance; float32 rounding in a different order moves them by about 1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch
from jaxtyping import Float, Int
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.interop import Architecture, check_exportable
from scratchlm.interop.adapter import StateDictAdapter
from scratchlm.interop.formats import EXPORT_FORMATS
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.load import TrainedModel

TOLERANCE = 1e-4  # on the largest logit difference, relative to the largest logit (at least 1)
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def check_export(
    trained: TrainedModel,
    adapters: Sequence[type[StateDictAdapter]],
    dtype: str,
    dtypes: Sequence[str] = tuple(DTYPES),
) -> tuple[Architecture, type[StateDictAdapter]]:
    """What every export checks before any work: the architecture that computes the model exactly
    (`check_exportable`) among those of `adapters` (the format's, the preferred first), and the adapter that
    writes it; a `dtype` of `dtypes`, those the format writes (`DTYPES` unless it says); a tokenizer to write
    beside the weights."""
    format = adapters[0].format
    architectures = [architecture for adapter in adapters for architecture in adapter.architectures]
    reader = EXPORT_FORMATS[format].target
    architecture = check_exportable(trained.model.config, format, reader, architectures)
    if dtype not in dtypes:
        raise ScratchlmError(
            f"--format {format} does not write --dtype {dtype}; choose one of {', '.join(dtypes)}"
        )
    if trained.tokenizer is None:
        raise ScratchlmError(f"no tokenizer found for {trained.checkpoint}; pass --tokenizer DIR")
    return architecture, next(a for a in adapters if architecture in a.architectures)


def optional_transformers() -> ModuleType | None:
    """transformers if it is installed (the check is skipped, with a warning, when it is not)."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        return None


@contextlib.contextmanager
def quiet(transformers: ModuleType) -> Iterator[None]:
    """transformers without its progress bars and warnings (a command prints its own summary), as before
    afterwards."""
    logging = transformers.utils.logging
    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        if bars:
            logging.enable_progress_bar()
        logging.set_verbosity(verbosity)


def dtype_keyword(transformers: ModuleType) -> str:
    """`from_pretrained`'s name for the dtype to load in: `dtype` from transformers 4.56, `torch_dtype` before."""
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def fixed_input(model: TransformerLM) -> Int[Tensor, "2 seq"]:
    """Two sequences of up to 64 token ids, the same for a given vocabulary and context every time."""
    c = model.config
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, c.vocab_size, (2, min(c.context_length, 64)), generator=generator)


def as_stored(model: TransformerLM, dtype: str, vectors_too: bool = True) -> TransformerLM:
    """A float32 copy of `model` whose weights went through `dtype` as the file stores them: every tensor, or
    only the matrices when `vectors_too` is false (GGUF keeps the RMSNorm gains in float32)."""
    stored = copy.deepcopy(model).float()
    with torch.no_grad():
        for parameter in stored.parameters():
            if parameter.dim() >= 2 or vectors_too:
                parameter.copy_(parameter.to(DTYPES[dtype]).float())
    return stored


def check_logits(
    reference: TransformerLM,
    external: Callable[[Tensor], Float[Tensor, "batch seq vocab"]],
    what: str,
) -> float:
    """The largest difference between the logits of `reference` and of `external` on `fixed_input`; a
    `ScratchlmError` when it exceeds the tolerance."""
    tokens = fixed_input(reference)
    with torch.no_grad():
        ours = reference.float()(tokens)
        theirs = external(tokens).float()
    if theirs.shape[-1] != ours.shape[-1]:
        raise ScratchlmError(
            f"{what} has {theirs.shape[-1]} logits per token, scratchlm's model {ours.shape[-1]}"
        )
    difference = (ours - theirs).abs().max().item()
    tolerance = TOLERANCE * max(1.0, ours.abs().max().item())
    if not difference <= tolerance:
        raise ScratchlmError(
            f"{what} computes other logits than the scratchlm model (largest difference {difference:.2e}, "
            f"tolerance {tolerance:.1e}); nothing was written"
        )
    return difference
