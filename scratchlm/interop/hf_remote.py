"""transformers with scratchlm's own modeling code: how a model that no transformers architecture computes
(post-norm, NoPE, a SiLU or ReLU² MLP, logit soft-capping, value embeddings, U-net skips: the fast recipe's
model, for one) is exported, and read back.

Such an export directory holds what `hf.py` writes for every export (model.safetensors, generation_config.json,
the tokenizer), with:

    config.json                  model_type "scratchlm", architectures ["ScratchlmForCausalLM"], and `auto_map`
                                 naming the two files below; the shape under transformers' usual names
                                 (`SHAPE_NAMES`) and the switches under scratchlm's (`SWITCHES`)
    configuration_scratchlm.py   `ScratchlmConfig`
    modeling_scratchlm.py        `ScratchlmForCausalLM`: scratchlm's model written for transformers, with its KV
                                 cache, attention mask and `generate`; it imports torch and transformers only

`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` runs the two files, which scratchlm ships as
package data (`remote_code/`) and copies unchanged. Their model keeps scratchlm's tensor names and layouts
(RoPE's adjacent pairs included), so `RemoteCodeAdapter` renames nothing, and an import reads the tensors back
bit for bit.
"""

from __future__ import annotations

import importlib.resources
import inspect
import shutil
from pathlib import Path
from typing import Any

from scratchlm.errors import ScratchlmError
from scratchlm.interop import SCRATCHLM
from scratchlm.interop.adapter import StateDictAdapter
from scratchlm.model.config import ModelConfig

REMOTE_CODE = importlib.resources.files("scratchlm.interop") / "remote_code"
FILES = ("configuration_scratchlm.py", "modeling_scratchlm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_scratchlm.ScratchlmConfig",
    "AutoModelForCausalLM": "modeling_scratchlm.ScratchlmForCausalLM",
}
# `ModelConfig`'s shape -> config.json's names, which tools that read any checkpoint's shape know.
SHAPE_NAMES = {
    "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
    "d_model": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
}
# Those an export always writes and an import needs; the others default to `ModelConfig`'s values.
REQUIRED = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")
# The switches the modeling code reads, and zero_init, which it does not (it changes only the initial weights)
# but which makes the imported configuration the exported one.
SWITCHES = (*SCRATCHLM.free, "zero_init")


class RemoteCodeAdapter(StateDictAdapter):
    """scratchlm <-> its own transformers code: the same names, the same layouts."""

    format = "hf"
    architectures = (SCRATCHLM,)
    rotates_halves = False
    names: dict[str, str] = {}

    def external_name(self, key: str) -> str:
        return key


def remote_config(config: ModelConfig) -> dict[str, Any]:
    """The model's part of config.json: `auto_map`, the shape, the switches."""
    values: dict[str, Any] = {"auto_map": AUTO_MAP}
    values |= {theirs: getattr(config, ours) for ours, theirs in SHAPE_NAMES.items()}
    values["num_key_value_heads"] = config.kv_heads
    return values | {name: getattr(config, name) for name in SWITCHES}


def model_config_from_remote(values: dict[str, Any], source: str) -> ModelConfig:
    """The `ModelConfig` of a config.json that `remote_config` wrote (or transformers saved again); a field it
    lacks takes `ModelConfig`'s default, which is also `ScratchlmConfig`'s, except the `REQUIRED` ones."""
    missing = [SHAPE_NAMES[ours] for ours in REQUIRED if SHAPE_NAMES[ours] not in values]
    if missing:
        raise ScratchlmError(f"{source} has no {', '.join(missing)}")
    fields = {ours: values[theirs] for ours, theirs in SHAPE_NAMES.items() if theirs in values}
    fields |= {name: values[name] for name in SWITCHES if name in values}
    try:
        return ModelConfig(**fields)
    except (ScratchlmError, TypeError, ValueError) as e:
        raise ScratchlmError(f"{source}: {e}") from None


def copy_remote_code(directory: Path) -> None:
    """Write the modeling code's files into the export `directory`."""
    for name in FILES:
        (directory / name).write_bytes((REMOTE_CODE / name).read_bytes())


def remove_code_copy(model: Any, directory: Path) -> None:
    """Remove the copy of its code that transformers made to load `model` from `directory`, an export's
    temporary directory, which nothing loads again. transformers runs a checkpoint's code from a copy in its
    modules cache, in a folder named after the checkpoint's directory (`transformers_modules/<name>/...`); the
    folder is removed only if its name carries the temporary directory's unique suffix."""
    suffix = directory.name.rsplit("-", 1)[-1]
    for folder in Path(inspect.getfile(type(model))).parents:
        if folder.parent.name == "transformers_modules":
            if folder.name.endswith(suffix):
                shutil.rmtree(folder, ignore_errors=True)
            return
