"""LoRA: low-rank adapters on the blocks' matrices of an unchanged `TransformerLM` (Hu et al., 2021).

A frozen weight `W (out, in)` gains a trainable product of two thin matrices, and the layer computes

    y = x Wᵀ + (α / r) · (x Aᵀ) Bᵀ          A (r, in), B (out, r), r ≪ min(in, out)

so the update the fine-tuning learns, `ΔW = (α / r) B A`, has rank at most r. `A` starts uniform on ±1/sqrt(in)
(Kaiming-uniform with a = sqrt(5), what peft does) and `B` at zero, so that at the first step
`ΔW = 0` and the model is exactly its base; the gradient reaches `B` first (`∂L/∂B = (α/r) gᵀ (x Aᵀ)`), then
`A`. The scaling `α / r` keeps the size of the update the same across ranks for one learning rate: the default
`α = 2 r` (a scaling of 2, whatever the rank) means a rate measured at one rank holds at another.

The targets are the blocks' matrices and may be the LM head (`lm_head`): in the training loss the head's
product is fused with the cross-entropy (`scratchlm.model.loss`), which takes one matrix, and the adapted
head hands it one, `[x, s x Aᵀ] [W, B]ᵀ` (`LoRALinear.as_one_product`). Tables can also train whole beside
the adapters (`LoRAConfig.train`, peft's `modules_to_save`).

`apply_lora` patches the `Linear`s of the blocks in place (their class becomes `LoRALinear`, a `Linear` with
the two extra parameters, so the state dict keeps every key of the base and adds `...q_proj.lora_A`,
`...q_proj.lora_B`), and freezes every other parameter; `merge_lora` folds `W + (α/r) B A` back into `W` and
turns them into plain `Linear`s again. Nothing in the model's code knows of it: a model declares its
adapters to the optimizer through `Linear.adapters()`, which is empty for a plain `Linear`.

**The frozen base in 16 bits.** A frozen weight has no gradient and no optimizer state, so in float32 it is 4 of
full fine-tuning's 16 bytes a parameter: a quarter of the state before a single adapter. `apply_lora`'s
`base_dtype` stores every frozen matrix (the blocks', the LM head, the embedding tables) in 16 bits, 2 bytes,
whatever the plan computes in: under autocast (a bf16 or fp16 plan) the products take the 16-bit weight as
they would a float32 one; on a float32 plan a frozen `Linear` whose weight is narrower than its input upcasts it
at use (`scratchlm.model.layers.upcast_linear`, which keeps only the 16-bit weight for the backward pass), and
an `Embedding` returns its rows in the dtype it had (`Embedding.compute_dtype`), so that the residual stream
keeps its precision. QLoRA (Dettmers et al., 2023) goes further, to 4 bits. The adapters stay float32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import LoRAConfig
from scratchlm.model.layers import Embedding, Linear

HEAD = "lm_head"  # the LM head, a target beside the blocks' matrices
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def storage_dtype(config: LoRAConfig, compute: torch.dtype) -> torch.dtype | None:
    """The dtype `config.base_dtype` stores the frozen weights in on a plan computing in `compute`; None where
    that is float32, the dtype they are read in (nothing to convert)."""
    precision = {dtype: name for name, dtype in DTYPES.items()}[compute]
    stored = DTYPES[config.base_precision(precision)]
    return None if stored == torch.float32 else stored


@dataclass(frozen=True)
class Adapters:
    """What a model carries once adapted: the config, and the base it was adapted from (its path and the
    fingerprint of its weights and config), which a checkpoint of the adapters records."""

    config: LoRAConfig
    base: str = ""
    base_fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        recorded = {"targets": list(self.config.targets), "base": self.base}
        return asdict(self.config) | recorded | {"base_fingerprint": self.base_fingerprint}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Adapters:
        # `base_dtype` is recorded since it was added; older records train on as "auto" would
        base_dtype = values.get("base_dtype", "auto")
        config = LoRAConfig(
            int(values["rank"]),
            float(values["alpha"]),
            tuple(values["targets"]),
            base_dtype,
            tuple(values.get("train", ())),
        )
        return cls(config, values.get("base", ""), values.get("base_fingerprint", ""))


class LoRALinear(Linear):
    """A `Linear` with a low-rank update: `x Wᵀ + s (x Aᵀ) Bᵀ`. Made by `add_lora` from a `Linear`, never
    constructed."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        # Two thin products rather than x (W + s B A)ᵀ: r (in + out) multiply-adds a token instead of
        # in · out, and no dense copy of B A is made.
        low_rank = (x @ self.lora_A.T) @ self.lora_B.T
        return super().forward(x) + self.scaling * low_rank

    def adapters(self) -> list[nn.Parameter]:
        return [self.lora_A, self.lora_B]

    def as_one_product(
        self, x: Float[Tensor, "... d_in"]
    ) -> tuple[Float[Tensor, "... d"], Float[Tensor, "d_out d"]]:
        # x Wᵀ + s (x Aᵀ) Bᵀ = [x, s x Aᵀ] [W, B]ᵀ: the adapted head as one product of r more columns, which
        # the fused loss takes whole (the logits are never made). W joins B's float32 for the product.
        low_rank = self.scaling * (x @ self.lora_A.T.to(x.dtype))
        weight = torch.cat([self.weight.to(self.lora_B.dtype), self.lora_B], dim=1)
        return torch.cat([x.to(weight.dtype), low_rank.to(weight.dtype)], dim=-1), weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def add_lora(linear: Linear, rank: int, scaling: float) -> LoRALinear:
    """Turn `linear` into a `LoRALinear` in place (same object, same weight): `A` Kaiming-uniform, `B` zero,
    both float32 (the adapters and their optimizer state are trained in full precision whatever the base's)."""
    weight = linear.weight
    a = torch.empty(rank, linear.in_features, device=weight.device, dtype=torch.float32)
    # Uniform on ±1/sqrt(in): Kaiming-uniform with a = sqrt(5), gain sqrt(2 / (1 + a²)) = sqrt(1/3), bound
    # sqrt(3) · gain / sqrt(in); the init of peft's A, written out.
    bound = 1 / math.sqrt(linear.in_features)
    a.uniform_(-bound, bound)
    b = torch.zeros(linear.out_features, rank, device=weight.device, dtype=torch.float32)
    linear.__class__ = LoRALinear
    linear.lora_A, linear.lora_B = nn.Parameter(a), nn.Parameter(b)
    linear.scaling = scaling
    return linear  # type: ignore[return-value]


def apply_lora(
    model: nn.Module, adapters: Adapters, train: tuple[str, ...] = (), base_dtype: torch.dtype | None = None
) -> int:
    """Adapt `model`'s blocks (`model.layers`, and the head where `lm_head` is a target) as `adapters.config`
    says and freeze everything else except the tables `config.train` names and the parameters named in `train`
    (e.g. the embeddings of tokens the base lacked); the frozen matrices (the
    blocks', the head, the embedding tables; not the gains) are stored in `base_dtype` when given (a 16-bit base
    halves its memory; see the module docstring), and compute as before. Records `adapters` as
    `model.lora_adapters`. Returns the number of matrices adapted; a target no block has is an error naming
    it."""
    config = adapters.config
    linears = {name: m for name, m in model.layers.named_modules() if isinstance(m, Linear)}
    known = sorted({name.rsplit(".", 1)[-1] for name in linears}) + [HEAD]
    unknown = [t for t in config.targets if t not in known]
    if unknown:
        raise ScratchlmError(f"lora.targets: no block has a matrix {unknown[0]!r}; the blocks' are {known}")
    if HEAD in config.targets:
        if model.lm_head.weight is model.token_embeddings.weight:
            raise ScratchlmError(
                f"lora.targets names {HEAD!r}, but this base's head is its embedding table (tied): an adapter "
                "there would move only the head's half; adapt the blocks, or train the table whole (lora.train)"
            )
        linears[HEAD] = model.lm_head
    names = {name.split(".")[0] for name, _ in model.named_parameters()}  # a tied head: token_embeddings
    absent = [table for table in config.train if table not in names]
    if absent:
        raise ScratchlmError(
            f"lora.train names {absent[0]!r}, which this base has not"
            + (" (its head is its embedding table: name token_embeddings)" if absent[0] == HEAD else "")
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, p in model.named_parameters():
        if name in train or name.split(".")[0] in config.train:
            p.requires_grad_(True)
    if base_dtype is not None:
        store_frozen(model, base_dtype)
    adapted = 0
    for name, linear in linears.items():
        if name.rsplit(".", 1)[-1] in config.targets:
            add_lora(linear, config.rank, config.scaling)
            adapted += 1
    model.lora_adapters = adapters
    return adapted


def store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen weights of `model`'s `Linear`s and `Embedding`s in `dtype`; each `Embedding` so stored
    returns its rows in the dtype it had. Records the dtypes they had as `model.lora_stored_from` (by
    parameter name), which `merge_lora` gives back."""
    had = {name: p.dtype for name, p in model.named_parameters()}  # a tied matrix under its first name only
    by_id = {id(p): had[name] for name, p in model.named_parameters()}
    stored = getattr(model, "lora_stored_from", {})
    for module in model.modules():
        if not isinstance(module, Linear | Embedding) or module.weight.requires_grad:
            continue
        weight = module.weight
        if isinstance(module, Embedding) and by_id[id(weight)] != dtype:
            module.compute_dtype = by_id[id(weight)]
        weight.data = weight.data.to(dtype)
    for name, p in model.named_parameters():
        if p.dtype != had[name]:
            stored.setdefault(name, had[name])
    model.lora_stored_from = stored


def adapters_of(model: nn.Module) -> Adapters | None:
    """The adapters `apply_lora` recorded on `model`, None for a model without."""
    return getattr(model, "lora_adapters", None)


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """The state-dict entries of `model`'s trainable parameters only (the adapters, and what `apply_lora` was
    told to train): what a checkpoint of an adapted model holds."""
    state = model.state_dict(keep_vars=True)
    return {key: value.detach() for key, value in state.items() if value.requires_grad}


def load_trainable(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Load `trainable_state`'s entries into an adapted `model`: exactly its trainable tensors, no others."""
    expected = set(trainable_state(model))
    if set(state) != expected:
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise ScratchlmError(
            f"{source} does not hold this run's adapters: "
            + (f"unexpected {extra[0]}" if extra else f"missing {missing[0]}")
            + f" ({len(extra)} unexpected, {len(missing)} missing)"
        )
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its matrix, `W ← W + (α/r) B A` (computed in float32, stored in W's dtype), and
    turn the `LoRALinear`s back into `Linear`s: the same model, with the cost of the base at inference.
    A base `apply_lora` stored in fewer bits gets its dtypes back first (float32, as the model was built), so
    the update is not rounded to 16 bits against the weight it is added to (bf16 keeps 8 significant bits, and
    `ΔW` is usually far smaller than `W`: most of it would round away). Returns the number of matrices
    merged."""
    params = dict(model.named_parameters())
    for name, dtype in getattr(model, "lora_stored_from", {}).items():
        params[name].data = params[name].data.to(dtype)
    for module in model.modules():
        if isinstance(module, Embedding):
            module.compute_dtype = None
    merged = 0
    for module in model.modules():
        if isinstance(module, LoRALinear):
            weight = module.weight
            delta = module.scaling * (module.lora_B.float() @ module.lora_A.float())
            weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
            del module.lora_A, module.lora_B, module.scaling
            module.__class__ = Linear
            merged += 1
    for attribute in ("lora_adapters", "lora_stored_from"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    return merged
