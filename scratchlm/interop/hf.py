"""Hugging Face transformers: export a scratchlm model as a transformers checkpoint directory, and import a
Llama-architecture checkpoint, or such an export, as a scratchlm run directory.

The export is written as the transformers architecture that computes the model exactly, when there is one: Llama
for the model of the CS336 assignment-1 handout, Qwen3 when QK-norm is its only addition. Those load with
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`, no custom code:

    config.json              LlamaForCausalLM (Qwen3ForCausalLM for QK-norm): the shape, rope_theta, rms_norm_eps,
                             tie_word_embeddings, no biases
    model.safetensors        the tensors under transformers' names (`HFAdapter.names`), W_Q and W_K rows
                             permuted from RoPE's adjacent pairs to halves; the LM head left out when tied
    generation_config.json   <|endoftext|> as the end of a sequence, and a chat model's end of turn (<|end|>):
                             transformers' `generate` stops where scratchlm's does
    tokenizer.json           byte-level BPE (`tokenizer_json`), with tokenizer_config.json, which holds a chat
                             model's template as `chat_template` (Jinja): `apply_chat_template` gives the ids
                             of scratchlm's template

Every other model is written with scratchlm's own modeling code (`hf_remote.py`): config.json names it, the two
files sit beside the weights, and `from_pretrained(DIR, trust_remote_code=True)` loads it.

Importing reads `config.json` and the safetensors (one file, or shards listed by model.safetensors.index.json),
refusing by name every setting of a Llama or Qwen3 checkpoint that scratchlm does not compute (rope scaling,
biases, another activation, sliding windows), and the tokenizer.json if there is one, with the chat template
where transformers finds it (`chat_template.jinja`, else tokenizer_config.json's `chat_template`): a chat model
stays one, for `scratchlm chat` and the server, and a scratchlm export gives back scratchlm's template. A
scratchlm export is read without running its code: its config.json names every setting. The run directory it
writes (`imported.py`) is one that `generate`, `chat`, `eval`, `export` and `train --init-from` take.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import Tensor

from scratchlm.chat.template import Message, chat_template
from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.interop import LLAMA, QWEN3, SCRATCHLM, Architecture, require, stop_ids
from scratchlm.interop.adapter import StateDictAdapter
from scratchlm.interop.formats import ExportResult
from scratchlm.interop.hf_remote import (
    RemoteCodeAdapter,
    copy_remote_code,
    model_config_from_remote,
    remote_config,
    remove_code_copy,
)
from scratchlm.interop.imported import import_run
from scratchlm.interop.tokenizer_json import (
    from_tokenizer_json,
    read_chat_template,
    to_tokenizer_json,
    usable_template,
)
from scratchlm.interop.verify import (
    DTYPES,
    as_stored,
    check_export,
    check_logits,
    optional_transformers,
    quiet,
)
from scratchlm.io import atomic_directory, check_output_dir, read_json
from scratchlm.model.config import DEFAULT_NORM_EPS, ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.load import TrainedModel, check_pair
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.tokenizer import Tokenizer

HF_EXPORT_KIND = "hf-export"  # the output marker of an exported directory (scratchlm.io)
# A text that exercises every kind of pre-token, special tokens and multi-byte characters: the exported
# tokenizer must give scratchlm's ids on it.
CHECK_TEXT = "Hello, world! It's 2024: naïve café, 東京, emoji 🙂.\n\n\tx  y {END_OF_TEXT}after"
# A conversation of several turns, with spaces, newlines and multi-byte characters in its messages: a chat
# model's exported template must give scratchlm's ids on it. No system message, which some templates refuse.
CHECK_CONVERSATION = (
    Message("user", "Hello! naïve café, 東京?"),
    Message("assistant", " Fine.\n\n\tAnd you? "),
    Message("user", "{{ not Jinja }}\n"),
)


class HFAdapter(StateDictAdapter):
    """scratchlm <-> transformers' Llama and Qwen3 (QK-norm) checkpoints, in both directions: export writes
    them, import reads them. transformers' RoPE rotates halves."""

    format = "hf"
    architectures = (LLAMA, QWEN3)
    rotates_halves = True
    names = {
        "token_embeddings.weight": "model.embed_tokens.weight",
        "layers.{i}.ln1.weight": "model.layers.{i}.input_layernorm.weight",
        "layers.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
        "layers.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
        "layers.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
        "layers.{i}.attn.output_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "layers.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # Qwen3
        "layers.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",  # Qwen3
        "layers.{i}.ln2.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.ffn.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
        "layers.{i}.ffn.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
        "layers.{i}.ffn.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
        "ln_final.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }


# -- export ----------------------------------------------------------------------------------------------------


def hf_config(
    config: ModelConfig, architecture: Architecture, tokenizer: Tokenizer, dtype: str
) -> dict[str, Any]:
    """config.json: transformers' names for the model of `config`."""
    eos = tokenizer.eos_id
    common: dict[str, Any] = {
        "architectures": [architecture.hf_class],
        "model_type": architecture.name,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."),
        "use_cache": True,
    }
    if architecture.custom_code:
        return common | remote_config(config)
    values = common | {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
    }
    if architecture is QWEN3:
        values |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config.num_layers,
        }
    return values


def write_tokenizer(tokenizer: Tokenizer, directory: Path, context_length: int) -> None:
    """tokenizer.json and tokenizer_config.json: a fast tokenizer that adds no tokens around the text, decodes
    without touching spaces and gives the model its ids and attention mask only; and a chat model's template,
    in tokenizer_config.json, where every version of transformers (and llama.cpp's converter) reads it."""
    eos = END_OF_TEXT if END_OF_TEXT in tokenizer.special_tokens else None
    _write_json(directory / "tokenizer.json", to_tokenizer_json(tokenizer))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "bos_token": eos,
        "eos_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # What it returns for the model: no token_type_ids, which no exported model takes.
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    _write_json(directory / "tokenizer_config.json", config)


def generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """generation_config.json: where transformers' `generate` stops, `stop_ids` (one id, or the list of them
    for a chat model, whose answer ends at its end of turn)."""
    ends = stop_ids(tokenizer)
    eos = tokenizer.eos_id
    return {"bos_token_id": eos, "eos_token_id": ends if len(ends) > 1 else eos}


def export_hf(trained: TrainedModel, out: str | os.PathLike, dtype: str = "f32") -> ExportResult:
    """Write `trained` (model and tokenizer) as a transformers checkpoint directory `out`, replacing an earlier
    export there: as Llama or Qwen3 where one computes the model exactly, with scratchlm's modeling code
    otherwise. With transformers installed the directory is loaded back and its logits compared with
    scratchlm's before it replaces `out`."""
    out = Path(out)
    config = trained.model.config
    architecture, adapter = check_export(trained, (HFAdapter, RemoteCodeAdapter), dtype)
    check_output_dir(out, HF_EXPORT_KIND)  # before any work: only an earlier export may be replaced
    safetensors_torch = require("safetensors.torch")
    model = trained.model.cpu().float()
    tensors = {k: v.to(DTYPES[dtype]) for k, v in adapter(config).to_external(model.state_dict()).items()}
    with atomic_directory(out, HF_EXPORT_KIND) as tmp:
        safetensors_torch.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", hf_config(config, architecture, trained.tokenizer, dtype))
        if architecture.custom_code:
            copy_remote_code(tmp)
        _write_json(tmp / "generation_config.json", generation_config(trained.tokenizer))
        write_tokenizer(trained.tokenizer, tmp, config.context_length)
        difference = _verify(tmp, architecture, model, trained.tokenizer, dtype)
    code = " with its modeling code" if architecture.custom_code else ""
    return ExportResult(out, architecture, difference, loaded_as=architecture.hf_class + code)


def _verify(
    directory: Path, architecture: Architecture, model: TransformerLM, tokenizer: Tokenizer, dtype: str
) -> float | None:
    """Load `directory` with transformers: its tokenizer must give scratchlm's ids on `CHECK_TEXT` (and, with a
    chat template, on `CHECK_CONVERSATION`), its model scratchlm's logits (`verify.check_logits`). None when
    transformers is not installed."""
    transformers = optional_transformers()
    if transformers is None:
        console.print("warning: transformers is not installed, so the export was not checked against it")
        return None
    # AutoTokenizer reads config.json too, so it is also told that the model's own code may run.
    trust = {"trust_remote_code": architecture.custom_code}
    with quiet(transformers):
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), **trust)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), **trust)
    if architecture.custom_code:
        remove_code_copy(hf_model, directory)
    hf_model = hf_model.float().eval()
    text = CHECK_TEXT.format(END_OF_TEXT=END_OF_TEXT)
    if hf_tokenizer.encode(text) != tokenizer.encode(text):
        raise ScratchlmError(f"transformers' tokenizer of {directory} encodes other ids than scratchlm's")
    template = chat_template(tokenizer)
    if template is not None:
        conversation = [{"role": m.role, "content": m.content} for m in CHECK_CONVERSATION]
        theirs = hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if list(theirs) != template.encode(CHECK_CONVERSATION):
            raise ScratchlmError(
                f"transformers' apply_chat_template with the chat template of {directory} gives other ids than "
                "scratchlm's; nothing was written"
            )
    return check_logits(as_stored(model, dtype), lambda ids: hf_model(ids).logits, "the transformers model")


# -- import ----------------------------------------------------------------------------------------------------


def model_config_from_hf(values: Any, source: str) -> tuple[ModelConfig, type[StateDictAdapter]]:
    """The `ModelConfig` of a transformers config.json (parsed), and the adapter that reads its tensors; a
    one-line error naming the field that scratchlm's model does not compute."""
    if not isinstance(values, dict):
        raise ScratchlmError(f"{source} is not a JSON object")
    if values.get("model_type") == SCRATCHLM.name:
        return model_config_from_remote(values, source), RemoteCodeAdapter
    architectures = {a.name: a for a in HFAdapter.architectures}
    architecture = architectures.get(values.get("model_type"))
    if architecture is None:
        names = ", ".join(repr(name) for name in [*architectures, SCRATCHLM.name])
        raise ScratchlmError(
            f"{source}: model_type {values.get('model_type')!r} is not supported; scratchlm imports the Llama "
            f"architecture and its own exports ({names})"
        )
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    )
    missing = [key for key in required if key not in values]
    if missing:
        raise ScratchlmError(f"{source} has no {', '.join(missing)}")
    rope = values.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling here
    unsupported = {
        "hidden_act": (values.get("hidden_act", "silu"), "silu"),
        "rope_scaling": (values.get("rope_scaling"), None),
        "rope_parameters.rope_type": (rope.get("rope_type", "default"), "default"),
        "attention_bias": (values.get("attention_bias", False), False),
        "mlp_bias": (values.get("mlp_bias", False), False),
        "use_sliding_window": (values.get("use_sliding_window", False), False),
    }
    for key, (value, expected) in unsupported.items():
        if value != expected:
            raise ScratchlmError(
                f"{source}: {key} = {json.dumps(value)} is not supported (scratchlm: {json.dumps(expected)})"
            )
    heads = values["num_attention_heads"]
    head_dim = values.get("head_dim")
    if (
        head_dim is not None
        and isinstance(heads, int)
        and heads
        and head_dim * heads != values["hidden_size"]
    ):
        raise ScratchlmError(
            f"{source}: head_dim = {head_dim} is not hidden_size / num_attention_heads, as scratchlm's is"
        )
    try:
        config = ModelConfig(
            vocab_size=values["vocab_size"],
            context_length=values["max_position_embeddings"],
            d_model=values["hidden_size"],
            num_layers=values["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=values.get("num_key_value_heads") or heads,
            d_ff=values["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", values.get("rope_theta", 10_000.0))),
            tie_embeddings=bool(values.get("tie_word_embeddings", False)),
            norm_eps=values.get("rms_norm_eps", DEFAULT_NORM_EPS),
            **architecture.departures,
        )
    except (ScratchlmError, TypeError, ValueError) as e:
        raise ScratchlmError(f"{source}: {e}") from None
    return config, HFAdapter


def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in `directory`, in float32: `model.safetensors`, or the shards that
    `model.safetensors.index.json` lists."""
    safetensors_torch = require("safetensors.torch")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ScratchlmError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        files, weight_map = ["model.safetensors"], None
    else:
        pickles = sorted(p.name for p in directory.glob("*.bin"))
        found = f" (found {pickles[0]}, a pickle: only safetensors are read)" if pickles else ""
        raise ScratchlmError(f"{directory} has no model.safetensors or model.safetensors.index.json{found}")
    tensors: dict[str, Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ScratchlmError(f"{path}, listed in {index.name}, not found")
        try:
            loaded = safetensors_torch.load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for truncated or foreign files
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ScratchlmError(f"cannot read {path}: {reason}") from None
        tensors.update({key: value.float() for key, value in loaded.items()})
    if weight_map is not None:
        absent = [key for key in weight_map if key not in tensors]
        if absent:
            raise ScratchlmError(f"{index} lists {absent[0]}, which is in none of its files")
    # Old checkpoints saved RoPE's frequencies, which are computed from rope_theta, not learnt.
    return {key: value for key, value in tensors.items() if not key.endswith("rotary_emb.inv_freq")}


def read_hf(source: str | os.PathLike) -> tuple[TransformerLM, Tokenizer | None]:
    """The scratchlm model (in eval mode) and tokenizer, with its chat template, of a transformers checkpoint
    directory."""
    directory = Path(source)
    if not directory.is_dir():
        raise ScratchlmError(f"{directory} is not a directory (expected a Hugging Face checkpoint directory)")
    config_path = directory / "config.json"
    config, adapter = model_config_from_hf(read_json(config_path), str(config_path))
    tokenizer = None
    tokenizer_path = directory / "tokenizer.json"
    if tokenizer_path.is_file():
        template = read_chat_template(directory)
        tokenizer = from_tokenizer_json(read_json(tokenizer_path), str(tokenizer_path), template)
        tokenizer = usable_template(tokenizer, directory)
        check_pair(config, tokenizer, None, str(tokenizer_path), f"the model of {config_path}")
    state = adapter(config).from_external(read_safetensors(directory), str(directory))
    model = TransformerLM(config)
    model.load_state_dict(state)
    return model.eval(), tokenizer


def import_hf(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Turn the transformers checkpoint directory `source` into the scratchlm run directory `out` (new, or
    empty; `imported.import_run`); returns `out`."""
    return import_run(source, out, read_hf, "import-hf")


def _write_json(path: Path, values: Any) -> None:
    path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
