"""`StateDictAdapter`: scratchlm's state dict <-> an external format's tensors, one subclass per format (after
torchtitan's `state_dict_adapter`, whose `to_hf`/`from_hf` are `to_external`/`from_external` here).

A subclass is the format's whole account of its tensors: `names` maps each scratchlm tensor name to the
format's (`{i}` standing for a block's index; a format that keeps scratchlm's names overrides `external_name`
instead), `architectures` lists the architectures it writes, and `rotates_halves` says how its RoPE pairs a
head's dimensions. A new format adds its own mapping in its own module; nothing here lists the formats.

The one layout difference is RoPE's. scratchlm rotates adjacent pairs of a head's dimensions, `(x0, x1),
(x2, x3), ...` (as Meta's original Llama code and llama.cpp's "llama" architecture do); transformers rotates
halves, `(x0, x_{d/2}), (x1, x_{d/2+1}), ...`. The same function results when the rows of each head of W_Q
and W_K are reordered so that the pairs' first members come first (`pairs_to_halves`): a query row
permutation applied to both queries and keys leaves every dot product, hence every score, unchanged.
docs/interop.md has the details.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.interop import Architecture
from scratchlm.model.config import ModelConfig


def pairs_to_halves(weight: Float[Tensor, "rows ..."], heads: int) -> Float[Tensor, "rows ..."]:
    """Reorder each head's rows `(x0, x1, x2, x3, ...)`, rotated by scratchlm as pairs `(x0, x1), (x2, x3)`,
    into `(x0, x2, ..., x1, x3, ...)`, rotated by transformers as halves."""
    return rearrange(weight, "(heads half two) ... -> (heads two half) ...", heads=heads, two=2)


def halves_to_pairs(weight: Float[Tensor, "rows ..."], heads: int) -> Float[Tensor, "rows ..."]:
    """The inverse of `pairs_to_halves`."""
    return rearrange(weight, "(heads two half) ... -> (heads half two) ...", heads=heads, two=2)


@dataclass(frozen=True)
class TensorName:
    """One tensor under both names; `heads` is set for the rows RoPE rotates (W_Q, W_K and QK-norm gains)."""

    ours: str
    theirs: str
    heads: int | None = None


class StateDictAdapter:
    """scratchlm's state dict <-> an external format's tensors, for the model of `config`. Abstract: a
    subclass per format gives the class attributes below. The tensors are those of the scratchlm model the
    config builds, so a tensor that the format has no name for (QK-norm's gains in a format without Qwen3) is
    a `KeyError`, which `check_exportable` over `architectures` rules out beforehand. Tied embeddings are one
    tensor in the external dict (the embedding matrix) and both `token_embeddings.weight` and
    `lm_head.weight` in scratchlm's."""

    format: ClassVar[str]  # the export format's name (`formats.EXPORT_FORMATS`), for messages
    architectures: ClassVar[Sequence[Architecture]]  # those the format writes
    rotates_halves: ClassVar[bool]  # its RoPE pairs x_k with x_{k+d/2}, not x_{2k} with x_{2k+1}
    names: ClassVar[dict[str, str]]  # scratchlm's name -> the format's, for every tensor the format has

    def __init__(self, config: ModelConfig) -> None:
        from scratchlm.model.transformer import TransformerLM

        self.config = config
        # The model's own tensors, in its order (built on the meta device: shapes, no memory).
        meta = TransformerLM(config, device="meta").state_dict()
        self.shapes = {key: tuple(value.shape) for key, value in meta.items()}

    def external_name(self, key: str) -> str:
        """The format's name of scratchlm's tensor `key`, from `names`."""
        if key.startswith("layers."):
            _, layer, name = key.split(".", 2)
            return self.names[f"layers.{{i}}.{name}"].format(i=layer)
        return self.names[key]

    def entries(self) -> list[TensorName]:
        """Every tensor the format stores for this model, under both names, in the model's order."""
        c = self.config
        rotated = {"attn.q_proj.weight": c.num_heads, "attn.k_proj.weight": c.kv_heads}
        rotated |= {"attn.q_norm.weight": 1, "attn.k_norm.weight": 1}  # one head's gains, shared by all
        entries = []
        for key in self.shapes:
            if key == "lm_head.weight" and c.tie_embeddings:
                continue
            heads = rotated.get(key.split(".", 2)[2]) if key.startswith("layers.") else None
            entries.append(TensorName(key, self.external_name(key), heads))
        return entries

    def to_external(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for entry in self.entries():
            tensor = state_dict[entry.ours]
            if entry.heads is not None and self.rotates_halves:
                tensor = pairs_to_halves(tensor, entry.heads)
            out[entry.theirs] = tensor.contiguous()
        return out

    def from_external(self, tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
        """scratchlm's state dict from exactly the tensors `entries` lists, of the shapes the model has; a
        one-line error naming a missing, unexpected or misshapen tensor of `source`."""
        entries = self.entries()
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
