"""peft: a LoRA run's adapters as a peft adapter directory, loaded onto the transformers export of its base.

    adapter_model.safetensors   `base_model.model.<transformers' name of the matrix>.lora_A.weight` (r, in) and
                                `...lora_B.weight` (out, r), in float32
    adapter_config.json         peft_type LORA, r, lora_alpha, target_modules (transformers' names: q_proj,
                                k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head), no dropout, no
                                bias; modules_to_save: the tables trained whole (`lora.train`: embed_tokens,
                                lm_head), saved whole as `base_model.model.<name>.weight`

peft computes `W x + (lora_alpha / r) B A x`, scratchlm's update exactly. The one layout difference is the
base's: the transformers export permutes the rows of W_Q and W_K from RoPE's adjacent pairs to halves
(`scratchlm.interop.adapter`), so the rows of those matrices' `B` (the update's output rows) are permuted the
same way; `A` reads the input, which is not permuted. `base_model_name_or_path` is the base run's path: the
adapter goes onto `scratchlm export --run BASE --format hf`. With peft and transformers installed, the base is
exported to a temporary directory, the adapter loaded onto it with `PeftModel.from_pretrained`, and its logits
compared with the LoRA run's (merged) before the directory takes its name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.interop import require
from scratchlm.interop.adapter import pairs_to_halves
from scratchlm.interop.formats import ExportResult
from scratchlm.interop.hf import HFAdapter, _write_json, export_hf
from scratchlm.interop.verify import DTYPES, check_export, check_logits, optional_transformers, quiet
from scratchlm.io import atomic_directory
from scratchlm.model.lora import Adapters
from scratchlm.run.load import TrainedModel, load_trained, read_any

PEFT_EXPORT_KIND = "peft-export"


class PeftAdapter(HFAdapter):
    """transformers' names, for the matrices that carry the adapters."""

    format = "peft"


def export_peft(trained: TrainedModel, out: str | os.PathLike, dtype: str = "f32") -> ExportResult:
    """Write the adapters of the LoRA run `trained` as a peft adapter directory `out` (the module docstring)."""
    if trained.lora is None:
        raise ScratchlmError(
            f"--format peft: {trained.checkpoint} is not a LoRA run (no adapters); --format hf writes its model"
        )
    architecture, _ = check_export(trained, (PeftAdapter,), dtype, dtypes=("f32",))
    checkpoint = read_any(trained.checkpoint)
    adapters = Adapters.from_dict(checkpoint.lora)
    whole = {key for key in checkpoint.model if key.split(".")[0] in adapters.config.train}
    others = [
        key for key in checkpoint.model if not key.endswith((".lora_A", ".lora_B")) and key not in whole
    ]
    if others:
        raise ScratchlmError(
            f"--format peft: {trained.checkpoint} also trained {others[0]} (the vocabulary grew from its base's), "
            "which an adapter of the base cannot hold; export the merged model with --merge --format hf"
        )
    config, names = trained.model.config, PeftAdapter(trained.model.config)
    heads = {"attn.q_proj": config.num_heads, "attn.k_proj": config.kv_heads}
    tensors, modules, saved = {}, set(), set()
    for key, tensor in checkpoint.model.items():
        if key in whole:
            # A table trained whole (`lora.train`): peft's `modules_to_save`, the whole tensor under its name.
            theirs = names.external_name(key)
            tensors[f"base_model.model.{theirs}"] = tensor.to(DTYPES[dtype]).contiguous()
            saved.add(theirs.removesuffix(".weight").rsplit(".", 1)[-1])
            continue
        stem, factor = key.rsplit(".", 1)  # "layers.3.attn.q_proj", "lora_B"; "lm_head", "lora_A"
        theirs = names.external_name(f"{stem}.weight").removesuffix(".weight")
        if factor == "lora_B" and (rotated := heads.get(stem.split(".", 2)[-1])) is not None:
            tensor = pairs_to_halves(tensor, rotated)
        tensors[f"base_model.model.{theirs}.{factor}.weight"] = tensor.to(DTYPES[dtype]).contiguous()
        modules.add(theirs.rsplit(".", 1)[-1])
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": adapters.base,
        "r": adapters.config.rank,
        "lora_alpha": adapters.config.rank * adapters.config.scaling,
        "target_modules": sorted(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "modules_to_save": sorted(saved) or None,
    }
    safetensors_torch = require("safetensors.torch")
    with atomic_directory(out, PEFT_EXPORT_KIND) as tmp:
        safetensors_torch.save_file(
            tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"}
        )
        _write_json(tmp / "adapter_config.json", adapter_config)
        difference = _verify(tmp, adapters.base, trained)
    return ExportResult(Path(out), architecture, difference, "peft LoRA on " + architecture.hf_class, "peft")


def _verify(directory: Path, base: str, trained: TrainedModel) -> float | None:
    """Load the adapter onto the transformers export of `base` with peft: its logits must be the merged LoRA
    run's. None when transformers or peft is not installed."""
    transformers = optional_transformers()
    try:
        import peft
    except ImportError:
        peft = None
    if transformers is None or peft is None:
        console.print("warning: peft or transformers is not installed, so the adapter was not checked")
        return None
    with tempfile.TemporaryDirectory() as scratch:
        exported = Path(scratch) / "base"
        export_hf(load_trained(base, tokenizer=trained.tokenizer), exported, dtype="f32")
        with quiet(transformers):
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
            model = peft.PeftModel.from_pretrained(hf_model, str(directory)).float().eval()
        return check_logits(trained.model, lambda ids: model(ids).logits, "peft on the transformers model")
