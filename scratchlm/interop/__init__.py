"""Into and out of the ecosystem: scratchlm models as Hugging Face transformers checkpoints and llama.cpp GGUF
files, and transformers checkpoints (Llama-architecture ones, and scratchlm's own) and GGUF files as scratchlm
runs.

Each format is one module, which holds all of it: its `StateDictAdapter` (after torchtitan's
`state_dict_adapter`: its names for scratchlm's tensors, their layouts, the architectures it writes), its
files and its export function. `formats.py` lists the formats that `scratchlm export --format` offers, one
line each.

    formats.py          the registry of export formats, `EXPORT_FORMATS`, and what an export returns
    adapter.py          `StateDictAdapter`: scratchlm's state dict <-> a format's tensors, RoPE's row order
    hf.py               transformers: config.json, model.safetensors, generation_config.json, the tokenizer;
                        `export_hf` and `import_hf`, as Llama or Qwen3 where they compute the model exactly
    hf_remote.py        transformers with the model's own code, for every other model: its config.json, the
                        files of `remote_code/` (configuration_scratchlm.py, modeling_scratchlm.py) copied in
    gguf.py             llama.cpp: one GGUF file with hyperparameters, tensors and tokenizer; `export_gguf`
    gguf_read.py        a GGUF file of the Llama architecture (any quantization) as a model and tokenizer;
                        `import_gguf`
    imported.py         what every import shares: a model and tokenizer written as a run directory
    checkpoint.py       scratchlm itself: a checkpoint (a sharded one consolidated) as one checkpoint file;
                        `export_checkpoint`
    tokenizer_json.py   HF `tokenizers`' tokenizer.json <-> scratchlm's byte-level BPE `Tokenizer`
    tokenizer_json_read.py  reading a tokenizer.json: what is accepted (as `EncodingOptions`) and what is
                        refused; `byte_level_tokenizer`, the one way token texts, merges and special tokens
                        become a `Tokenizer`, which GGUF's reading shares
    verify.py           the logits check every export passes before it is declared a success

This module holds what every format shares and the command line's parser may import (no torch): the
architectures the formats write, and `check_exportable`, which picks the one that computes exactly the model of
a configuration, or refuses, naming the features none of them has. The configuration is compared field by field
with the Llama architecture's, so a switch added to `ModelConfig` later is refused until an architecture learns
it: an upstream architecture computes fixed values of a few fields (`departures`); scratchlm's own, whose
modeling code travels with a transformers export (`remote_code/`), computes every value of the fields it reads
(`free`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import COMPUTATION_FIELDS, ModelConfig

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer

INSTALL_HINT = 'pip install "scratchlm[hf]"'

# Fields that every target represents: the shape, and the options the Llama architecture itself has.
SHAPE_FIELDS = frozenset(
    {
        "vocab_size",
        "context_length",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "d_ff",
        "rope_theta",
        "tie_embeddings",
        "norm_eps",  # rms_norm_eps (HF), layer_norm_rms_epsilon (GGUF)
    }
)
# Fields that change only the initial weights, never the function a trained model computes.
INIT_ONLY_FIELDS = frozenset({"zero_init"})
# The Llama architecture's values of the other fields; a field not named here must keep ModelConfig's default.
LLAMA_VALUES: dict[str, Any] = {"norm": "pre", "positions": "rope", "ffn": "swiglu"}

# How a refused value, or any value of a field, is named in messages (one not listed: by its setting). Each
# reads after "has no".
FEATURE_NAMES: dict[tuple[str, Any] | str, str] = {
    ("norm", "post"): "post-norm",
    ("norm", "none"): "blocks without RMSNorm",
    ("positions", "none"): "NoPE",
    ("ffn", "silu"): "SiLU MLP",
    ("ffn", "relu2"): "ReLU² MLP",
    ("qk_norm", True): "QK-norm",
    "logit_softcap": "logit soft-capping",  # any value but 0
    "value_embeddings": "value embeddings",
    ("unet_skips", True): "U-net skips",
}


@dataclass(frozen=True)
class Architecture:
    """An architecture of the targets: it computes exactly scratchlm's model whose fields differ from the Llama
    architecture's values by `departures`, and by any values of the fields `free` (those its own modeling code
    reads; an upstream architecture has none)."""

    name: str  # transformers' model_type and llama.cpp's general.architecture
    hf_class: str
    departures: dict[str, Any] = field(default_factory=dict)
    free: tuple[str, ...] = ()

    @property
    def custom_code(self) -> bool:
        """Whether a checkpoint of it carries the code that computes it (transformers: `trust_remote_code`)."""
        return bool(self.free)

    def lacks(self, departures: dict[str, Any]) -> dict[str, Any]:
        """Those of a configuration's `departures` that this architecture does not compute."""
        return {k: v for k, v in departures.items() if k not in self.free and self.departures.get(k) != v}

    def computes(self, departures: dict[str, Any]) -> bool:
        """Whether it computes exactly the model of a configuration with these `departures`."""
        fixed = {k: v for k, v in departures.items() if k not in self.free}
        return fixed == self.departures


LLAMA = Architecture("llama", "LlamaForCausalLM")
# Qwen3 is Llama plus an RMSNorm over each head's queries and keys before RoPE, one gain per head dimension
# shared by the heads, with the model's epsilon: exactly scratchlm's qk_norm.
QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", {"qk_norm": True})
# scratchlm's own model as transformers code (remote_code/modeling_scratchlm.py), every switch of it.
SCRATCHLM = Architecture(
    "scratchlm",
    "ScratchlmForCausalLM",
    free=("norm", "positions", "ffn", "qk_norm", "logit_softcap", "value_embeddings", "unet_skips"),
)


def describe(name: str, value: Any) -> str:
    """`post-norm (model.norm = 'post')`."""
    setting = f"model.{name} = {value!r}"
    feature = FEATURE_NAMES.get((name, value)) or FEATURE_NAMES.get(name)
    return f"{feature} ({setting})" if feature else setting


def one_of(items: Sequence[str]) -> str:
    """`a`, `a or b`, `a, b or c`."""
    return " or ".join(filter(None, (", ".join(items[:-1]), items[-1])))


def llama_departures(config: ModelConfig) -> dict[str, Any]:
    """The fields of `config` whose values the Llama architecture does not have."""
    departures = {}
    for f in dataclasses.fields(config):
        if f.name in SHAPE_FIELDS or f.name in INIT_ONLY_FIELDS or f.name in COMPUTATION_FIELDS:
            continue
        expected = LLAMA_VALUES.get(f.name, f.default)
        if getattr(config, f.name) != expected:
            departures[f.name] = getattr(config, f.name)
    return departures


def check_exportable(
    config: ModelConfig, format: str, reader: str, architectures: Sequence[Architecture]
) -> Architecture:
    """The first of `architectures`, those the export format `format` writes for `reader` (the program that
    reads it), that computes exactly the model of `config`; a one-line error naming the features none of them
    has, after the architecture that lacks the fewest, and saying where the model does export (`--format hf`,
    with scratchlm's modeling code) when the format has no such code."""
    departures = llama_departures(config)
    for architecture in architectures:
        if architecture.computes(departures):
            return architecture
    covering = [a for a in architectures if a.departures.items() <= departures.items()]
    best = min(covering, key=lambda a: len(a.lacks(departures)))
    missing = [describe(k, v) for k, v in best.lacks(departures).items()]
    elsewhere = not any(a.custom_code for a in architectures) and SCRATCHLM.computes(departures)
    raise ScratchlmError(
        f"cannot export to {format}: the {best.name} architecture of {reader} has no {one_of(missing)}"
        + ("; --format hf writes it with its modeling code" if elsewhere else "")
    )


def export_note(config: ModelConfig, architecture: Architecture) -> str | None:
    """What an export of the model of `config` as `architecture` says of it, when it is not Llama: which
    features chose the architecture."""
    if architecture == LLAMA:
        return None
    features = ", ".join(describe(k, v) for k, v in llama_departures(config).items())
    if architecture.custom_code:
        return (
            f"{features}: written as {architecture.hf_class} with its modeling code (load it with "
            "trust_remote_code=True)"
        )
    return f"{features}: written as {architecture.hf_class}, which computes the same function"


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids at which what a model writes ends, for a format's generation settings: `<|endoftext|>` first
    (a document's end, and the id a format's one end-of-sequence field holds), then a chat model's end of
    turn (`scratchlm.chat`), so that a reader's generation stops where scratchlm's does. Empty when the
    tokenizer has neither."""
    from scratchlm.chat.template import end_ids

    eos = tokenizer.eos_id
    return ([eos] if eos is not None else []) + sorted(end_ids(tokenizer) - {eos})


def require(module: str) -> ModuleType:
    """Import an optional dependency of `scratchlm[hf]`; a one-line error saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ScratchlmError(f"{module} is not installed; install it with: {INSTALL_HINT}") from None
