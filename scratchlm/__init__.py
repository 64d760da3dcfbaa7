"""scratchlm: train Transformer language models from scratch.

The public API is importable from the top-level package; each name is loaded on first use, so that
`import scratchlm` (and the command line) stays fast until torch is actually needed.

    from scratchlm import train_bpe, Tokenizer, TransformerLM, AdamW
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # data
    "build_corpus": "scratchlm.data.corpus",
    "build_text_corpus": "scratchlm.data.corpus",
    "download_dataset": "scratchlm.data.download",
    "prepare_data": "scratchlm.data.prepare",
    # tokenizer
    "train_bpe": "scratchlm.tokenizer.train",
    "Tokenizer": "scratchlm.tokenizer.tokenizer",
    "END_OF_TEXT": "scratchlm.tokenizer",
    # model
    "ModelConfig": "scratchlm.model.config",
    "Linear": "scratchlm.model.layers",
    "Embedding": "scratchlm.model.layers",
    "RMSNorm": "scratchlm.model.layers",
    "SwiGLU": "scratchlm.model.ffn",
    "silu": "scratchlm.model.ffn",
    "softmax": "scratchlm.model.attention",
    "scaled_dot_product_attention": "scratchlm.model.attention",
    "causal_attention": "scratchlm.model.attention",
    "RotaryPositionalEmbedding": "scratchlm.model.positions",
    "MultiHeadSelfAttention": "scratchlm.model.attention",
    "TransformerBlock": "scratchlm.model.transformer",
    "TransformerLM": "scratchlm.model.transformer",
    "KVCache": "scratchlm.model.kv_cache",
    # training
    "cross_entropy": "scratchlm.model.loss",
    "SGD": "scratchlm.training.optim",
    "AdamW": "scratchlm.training.optim",
    "cosine_lr_schedule": "scratchlm.training.schedule",
    "wsd_lr_schedule": "scratchlm.training.schedule",
    "Muon": "scratchlm.training.muon",
    "clip_grad_norm": "scratchlm.training.grad",
    "get_batch": "scratchlm.data.tokens",
    "load_tokens": "scratchlm.data.tokens",
    "save_checkpoint": "scratchlm.run.checkpoint",
    "load_checkpoint": "scratchlm.run.load",
    "build_optimizer": "scratchlm.training.optimizers",
    "parameter_groups": "scratchlm.training.optim",
    "TrainConfig": "scratchlm.training.config",
    "train": "scratchlm.training.trainer",
    "evaluate": "scratchlm.evaluation",
    # the run directory: summary, metrics, checkpoints, loading a trained model with its tokenizer
    "RunDirectory": "scratchlm.run",
    "RunSummary": "scratchlm.run",
    "StopReason": "scratchlm.run",
    "read_metrics": "scratchlm.run",
    "Checkpoint": "scratchlm.run",
    "TrainingState": "scratchlm.run",
    "check_pair": "scratchlm.run",
    "load_trained": "scratchlm.run",
    "TrainedModel": "scratchlm.run",
    "ScratchlmError": "scratchlm.errors",
    "DivergedError": "scratchlm.errors",
    # into and out of the ecosystem: transformers and llama.cpp
    "export_hf": "scratchlm.interop.hf",
    "import_hf": "scratchlm.interop.hf",
    "export_gguf": "scratchlm.interop.gguf",
    "import_gguf": "scratchlm.interop.gguf_read",
    # generation and experiments
    "generate": "scratchlm.generation.generate",
    "generate_stream": "scratchlm.generation.generate",
    "prepare_for_inference": "scratchlm.generation.layout",  # the plan's layout, quantize="int8" included
    "SamplingOptions": "scratchlm.generation.sampling",
    "plot_runs": "scratchlm.experiments.plot",
    "run_sweep": "scratchlm.experiments.sweep",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'scratchlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
