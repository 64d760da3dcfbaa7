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
    # tokenizer
    "train_bpe": "scratchlm.tokenizer.train",
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
