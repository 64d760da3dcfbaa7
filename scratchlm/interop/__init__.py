"""Into and out of the ecosystem: scratchlm models as Hugging Face transformers checkpoints and llama.cpp GGUF
files, and Llama-architecture checkpoints as scratchlm runs.

The seam is `StateDictAdapter`, one per external format (after torchtitan's `state_dict_adapter`): it renames
the tensors of scratchlm's state dict to the format's names and converts their layouts, in both directions.
Everything else of a format (its config file, its tokenizer, how it is written) lives in the format's module:

    hf.py               transformers: config.json, model.safetensors, generation_config.json, the tokenizer;
                        `export_hf` and `import_hf`
    gguf.py             llama.cpp: one GGUF file with hyperparameters, tensors and tokenizer; `export_gguf`
    tokenizer_json.py   HF `tokenizers`' tokenizer.json <-> scratchlm's byte-level BPE `Tokenizer`
    verify.py           the logits check every export passes before it is declared a success

The one layout difference is RoPE's. scratchlm rotates adjacent pairs of a head's dimensions, `(x0, x1), (x2,
x3), ...` (as Meta's original Llama code and llama.cpp's "llama" architecture do); transformers rotates halves,
`(x0, x_{d/2}), (x1, x_{d/2+1}), ...`. The same function results when the rows of each head of W_Q and W_K are
reordered so that the pairs' first members come first (`pairs_to_halves`): a query row permutation applied to
both queries and keys leaves every dot product, hence every score, unchanged. docs/interop.md has the details.

`check_exportable` refuses, naming the feature, any configuration that no architecture of the target
computes exactly: the configuration is compared field by field with the Llama architecture's, so a switch
added to `ModelConfig` later is refused until an exporter learns it.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from einops import rearrange
from jaxtyping import Float
from torch import Tensor

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
ARCHITECTURES = (LLAMA, QWEN3)
# The architectures each format is written in. llama.cpp runs Qwen3 too, but transformers' GGUF reader (the
# independent check of what is written) takes a Qwen3 file's head size from its default, not from the file.
FORMATS: dict[str, tuple[Architecture, ...]] = {"hf": (LLAMA, QWEN3), "gguf": (LLAMA,)}


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


def check_exportable(config: ModelConfig, format: str) -> Architecture:
    """The architecture of `format` that computes exactly the model of `config`; a one-line error naming the
    features none of them has."""
    if format not in FORMATS:
        raise ScratchlmError(f"unknown export format {format!r}; known: {', '.join(FORMATS)}")
    departures = llama_departures(config)
    for architecture in FORMATS[format]:
        if departures == architecture.departures:
            return architecture
    # Name what is left over from the architecture that covers the most.
    covering = [a for a in FORMATS[format] if a.departures.items() <= departures.items()]
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


def pairs_to_halves(weight: Float[Tensor, "rows ..."], heads: int) -> Float[Tensor, "rows ..."]:
    """Reorder each head's rows `(x0, x1, x2, x3, ...)`, rotated by scratchlm as pairs `(x0, x1), (x2, x3)`,
    into `(x0, x2, ..., x1, x3, ...)`, rotated by transformers as halves."""
    return rearrange(weight, "(heads half two) ... -> (heads two half) ...", heads=heads, two=2)


def halves_to_pairs(weight: Float[Tensor, "rows ..."], heads: int) -> Float[Tensor, "rows ..."]:
    """The inverse of `pairs_to_halves`."""
    return rearrange(weight, "(heads two half) ... -> (heads half two) ...", heads=heads, two=2)


# Every tensor under each format's name: scratchlm's, transformers' (Llama and Qwen3) and llama.cpp's ("llama"
# architecture). A block's tensors are named after the format's prefix for block {i} (`BLOCK_PREFIXES`) and
# before ".weight"; None: the format has no such tensor, and `check_exportable` refuses models that have it.
NAME_COLUMNS = ("scratchlm", "hf", "gguf")  # the export formats (`FORMATS`) after scratchlm
GLOBAL_NAMES = (
    ("token_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight"),
    ("ln_final.weight",         "model.norm.weight",         "output_norm.weight"),
    ("lm_head.weight",          "lm_head.weight",            "output.weight"),
)  # fmt: skip
BLOCK_PREFIXES = ("layers.{i}.", "model.layers.{i}.", "blk.{i}.")
BLOCK_NAMES = (
    ("ln1",              "input_layernorm",          "attn_norm"),
    ("attn.q_proj",      "self_attn.q_proj",         "attn_q"),
    ("attn.k_proj",      "self_attn.k_proj",         "attn_k"),
    ("attn.v_proj",      "self_attn.v_proj",         "attn_v"),
    ("attn.output_proj", "self_attn.o_proj",         "attn_output"),
    ("attn.q_norm",      "self_attn.q_norm",         None),
    ("attn.k_norm",      "self_attn.k_norm",         None),
    ("ln2",              "post_attention_layernorm", "ffn_norm"),
    ("ffn.w1",           "mlp.gate_proj",            "ffn_gate"),
    ("ffn.w3",           "mlp.up_proj",              "ffn_up"),
    ("ffn.w2",           "mlp.down_proj",            "ffn_down"),
)  # fmt: skip


def format_names(fmt: str) -> dict[str, str]:
    """scratchlm's name -> the name in the export format `fmt` ("hf", "gguf"), `{i}` standing for a block's
    index, for the tensors the format has."""
    column = NAME_COLUMNS.index(fmt)
    names = {row[0]: row[column] for row in GLOBAL_NAMES}
    ours, theirs = BLOCK_PREFIXES[0], BLOCK_PREFIXES[column]
    for row in BLOCK_NAMES:
        if row[column] is not None:
            names[f"{ours}{row[0]}.weight"] = f"{theirs}{row[column]}.weight"
    return names


@dataclass(frozen=True)
class TensorName:
    """One tensor under both names; `heads` is set for the rows RoPE rotates (W_Q, W_K and QK-norm gains)."""

    ours: str
    theirs: str
    heads: int | None = None


class StateDictAdapter:
    """scratchlm's state dict <-> an external format's tensors, for the model of `config`. Abstract: a
    subclass per format names its column of the names table (`format`, an export format) and says whether the
    format rotates halves. The tensors are those of the scratchlm model the config builds, so a tensor that the
    format has no name for is a `KeyError`, which `check_exportable` rules out beforehand. Tied embeddings are one tensor in the external dict (the embedding matrix) and
    both `token_embeddings.weight` and `lm_head.weight` in scratchlm's."""

    format: str
    rotates_halves: bool

    def __init__(self, config: ModelConfig) -> None:
        from scratchlm.model.transformer import TransformerLM

        self.config = config
        # The model's own tensors, in its order (built on the meta device: shapes, no memory).
        meta = TransformerLM(config, device="meta").state_dict()
        self.shapes = {key: tuple(value.shape) for key, value in meta.items()}

    def names(self) -> list[TensorName]:
        c = self.config
        rotated = {"attn.q_proj.weight": c.num_heads, "attn.k_proj.weight": c.kv_heads}
        rotated |= {"attn.q_norm.weight": 1, "attn.k_norm.weight": 1}  # one head's gains, shared by all
        theirs = format_names(self.format)
        entries = []
        for key in self.shapes:
            if key == "lm_head.weight" and c.tie_embeddings:
                continue
            if key.startswith("layers."):
                _, layer, name = key.split(".", 2)
                template = theirs[f"layers.{{i}}.{name}"]
                entries.append(TensorName(key, template.format(i=layer), rotated.get(name)))
            else:
                entries.append(TensorName(key, theirs[key]))
        return entries

    def to_external(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for entry in self.names():
            tensor = state_dict[entry.ours]
            if entry.heads is not None and self.rotates_halves:
                tensor = pairs_to_halves(tensor, entry.heads)
            out[entry.theirs] = tensor.contiguous()
        return out

    def from_external(self, tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
        """scratchlm's state dict from exactly the tensors `names` lists, of the shapes the model has; a
        one-line error naming a missing, unexpected or misshapen tensor of `source`."""
        entries = self.names()
        missing = [e.theirs for e in entries if e.theirs not in tensors]
        if missing:
            raise ScratchlmError(f"{source} has no tensor {missing[0]} ({len(missing)} missing)")
        unexpected = sorted(set(tensors) - {e.theirs for e in entries})
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise ScratchlmError(
                f"{source} has tensor {unexpected[0]}{more}, which the model of its config lacks"
            )
        state = {}
        for entry in entries:
            tensor = tensors[entry.theirs]
            if tuple(tensor.shape) != self.shapes[entry.ours]:
                raise ScratchlmError(
                    f"{source}: tensor {entry.theirs} has shape {tuple(tensor.shape)}, its config implies "
                    f"{self.shapes[entry.ours]}"
                )
            if entry.heads is not None and self.rotates_halves:
                tensor = halves_to_pairs(tensor, entry.heads)
            state[entry.ours] = tensor
        if self.config.tie_embeddings:
            state["lm_head.weight"] = state["token_embeddings.weight"]
        return state
