"""Into and out of the ecosystem: scratchlm models as Hugging Face transformers checkpoints and llama.cpp GGUF
files, and Llama-architecture checkpoints as scratchlm runs.

Each format is one module, which holds all of it: its `StateDictAdapter` (after torchtitan's
`state_dict_adapter`: its names for scratchlm's tensors, their layouts, the architectures it writes), its
files and its export function. `formats.py` lists the formats that `scratchlm export --format` offers, one
line each.

    formats.py          the registry of export formats, `EXPORT_FORMATS`, and what an export returns
    adapter.py          `StateDictAdapter`: scratchlm's state dict <-> a format's tensors, RoPE's row order
    hf.py               transformers: config.json, model.safetensors, generation_config.json, the tokenizer;
                        `export_hf` and `import_hf`
    gguf.py             llama.cpp: one GGUF file with hyperparameters, tensors and tokenizer; `export_gguf`
    tokenizer_json.py   HF `tokenizers`' tokenizer.json <-> scratchlm's byte-level BPE `Tokenizer`
    verify.py           the logits check every export passes before it is declared a success

This module holds what every format shares and the command line's parser may import (no torch):
`check_exportable` refuses, naming the feature, any configuration that no architecture of the target
computes exactly: the configuration is compared field by field with the Llama architecture's, so a switch
added to `ModelConfig` later is refused until an exporter learns it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import COMPUTATION_FIELDS, ModelConfig

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

# How a refused value, or any value of a field, is named in messages (one not listed: by its setting).
FEATURE_NAMES: dict[tuple[str, Any] | str, str] = {
    ("norm", "post"): "post-norm",
    ("norm", "none"): "no RMSNorm",
    ("positions", "none"): "NoPE (no position encoding)",
    ("ffn", "silu"): "the SiLU MLP",
    ("ffn", "relu2"): "the ReLU² MLP",
    ("qk_norm", True): "QK-norm",
    "logit_softcap": "logit soft-capping",  # any value but 0
    "value_embeddings": "value embeddings",
    ("unet_skips", True): "U-net skips",
}


@dataclass(frozen=True)
class Architecture:
    """An architecture of the targets that computes exactly scratchlm's model with the settings `departures`
    (the fields where it differs from Llama's values)."""

    name: str  # transformers' model_type and llama.cpp's general.architecture
    hf_class: str
    departures: dict[str, Any] = field(default_factory=dict)


LLAMA = Architecture("llama", "LlamaForCausalLM")
# Qwen3 is Llama plus an RMSNorm over each head's queries and keys before RoPE, one gain per head dimension
# shared by the heads, with the model's epsilon: exactly scratchlm's qk_norm.
QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", {"qk_norm": True})


def describe(name: str, value: Any) -> str:
    """`post-norm (model.norm = "post")`."""
    setting = f"model.{name} = {value!r}"
    feature = FEATURE_NAMES.get((name, value)) or FEATURE_NAMES.get(name)
    return f"{feature} ({setting})" if feature else setting


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


def check_exportable(config: ModelConfig, format: str, architectures: Sequence[Architecture]) -> Architecture:
    """The one of `architectures`, those the export format `format` writes, that computes exactly the model of
    `config`; a one-line error naming the features none of them has."""
    departures = llama_departures(config)
    for architecture in architectures:
        if departures == architecture.departures:
            return architecture
    # Name what is left over from the architecture that covers the most.
    covering = [a for a in architectures if a.departures.items() <= departures.items()]
    best = max(covering, key=lambda a: len(a.departures))
    missing = [describe(k, v) for k, v in departures.items() if k not in best.departures]
    via = f" (nor in {best.hf_class}, which adds {', '.join(describe(k, v) for k, v in best.departures.items())})"
    raise ScratchlmError(
        f"cannot export to {format}: the Llama architecture has no {', '.join(missing)}"
        f"{via if best is not LLAMA else ''}; only pre-norm RMSNorm, RoPE and SwiGLU models export exactly"
    )


def require(module: str) -> ModuleType:
    """Import an optional dependency of `scratchlm[hf]`; a one-line error saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ScratchlmError(f"{module} is not installed; install it with: {INSTALL_HINT}") from None
