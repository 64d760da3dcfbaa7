"""The model's hyperparameters in one dataclass, saved inside every checkpoint.

The defaults are the TinyStories model of the CS336 assignment-1 handout (≈17M non-embedding parameters). The ablation switches
of the experiments are fields too: `norm` (pre-norm, post-norm, or no RMSNorm at all), `positions` (RoPE or
none, i.e. NoPE), `ffn` (SwiGLU, or a SiLU MLP `W2 silu(W1 x)`) and `tie_embeddings` (the LM head reuses the
token embedding matrix). `num_kv_heads` below `num_heads` is grouped-query attention (Ainslie et al., 2023):
each key/value head serves `num_heads / num_kv_heads` query heads, as in Llama 2 70B and Llama 3.

The switches of the fast recipe (docs/experiments.md, "A faster recipe"), all off by default: `qk_norm`
(RMSNorm of each head's queries and keys before RoPE), `ffn="relu2"` (`W2 relu(W1 x)²`), `zero_init` (the
output projections of attention and feed-forward start at zero, so every block starts as the identity) and
`logit_softcap` (logits `c · tanh(z / c)`, bounded by ±c), `value_embeddings` (token embeddings of their
own added to the attention values of the first and last blocks) and `unet_skips` (each block of the second
half also reads the output of its mirror image in the first half).

`attention` chooses how attention is computed, not what: "triton" is the FlashAttention-2 kernel of
`scratchlm.kernels`, "torch" the blocked implementation written from tensor operations
(`scratchlm.model.attention.causal_attention`), and "auto" (default) the kernel for tensors on a CUDA device
when Triton imports, the blocked implementation elsewhere. It leaves the weights, the state dict and export alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from scratchlm.errors import ScratchlmError

NORMS = ("pre", "post", "none")
POSITIONS = ("rope", "none")
FFNS = ("swiglu", "silu", "relu2")
ATTENTIONS = ("auto", "triton", "torch")
DEFAULT_NORM_EPS = 1e-5  # the handout's RMSNorm epsilon, and LLaMA's
#: Fields that choose how the model's function is computed, not what it is (export and init_from ignore them).
COMPUTATION_FIELDS = frozenset({"attention"})


def default_d_ff(d_model: int, ffn: str = "swiglu") -> int:
    """SwiGLU: 8/3 · d_model rounded to a multiple of 64 (1,344 for 512); SiLU and ReLU²: 4 · d_model, the
    same parameter count as SwiGLU's three matrices."""
    if ffn in ("silu", "relu2"):
        return 4 * d_model
    return max(64, round(8 * d_model / 3 / 64) * 64)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 10_000
    context_length: int = 256
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 16
    num_kv_heads: int | None = None  # grouped-query attention: heads of keys and values; None: num_heads
    d_ff: int | None = None  # None: `default_d_ff(d_model, ffn)`
    rope_theta: float = 10_000.0
    norm: Literal["pre", "post", "none"] = "pre"
    positions: Literal["rope", "none"] = "rope"
    ffn: Literal["swiglu", "silu", "relu2"] = "swiglu"
    tie_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm (gain per head dimension) of queries and keys, per head, before RoPE
    zero_init: bool = False  # attention's and the feed-forward's output projections start at zero
    logit_softcap: float = 0.0  # c > 0: logits c · tanh(z / c); 0: off
    value_embeddings: int = 0  # n tables; block i and block num_layers - n + i add table i to their values
    unet_skips: bool = False  # block num_layers - 1 - i also reads block i's output (i < num_layers // 2)
    attention: Literal["auto", "triton", "torch"] = "auto"  # how attention is computed (not what)
    norm_eps: float = (
        DEFAULT_NORM_EPS  # RMSNorm's epsilon: a / sqrt(mean(a²) + eps); imported models bring theirs
    )

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model, self.ffn))
        sizes = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "num_kv_heads")
        for name in (*sizes, "d_ff"):
            value = self.kv_heads if name == "num_kv_heads" else getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ScratchlmError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ScratchlmError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.num_heads % self.kv_heads:
            raise ScratchlmError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.kv_heads})"
            )
        # One spelling of plain multi-head attention, so that equal models have equal configs.
        if self.num_kv_heads == self.num_heads:
            object.__setattr__(self, "num_kv_heads", None)
        if self.positions == "rope" and (self.d_model // self.num_heads) % 2:
            raise ScratchlmError(
                f"RoPE needs an even head dimension, got d_model/num_heads = {self.head_dim}"
            )
        if not self.rope_theta > 0:
            raise ScratchlmError(f"model.rope_theta must be positive, got {self.rope_theta!r}")
        for name, allowed in (
            ("norm", NORMS),
            ("positions", POSITIONS),
            ("ffn", FFNS),
            ("attention", ATTENTIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ScratchlmError(
                    f"model.{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}"
                )
        for name in ("tie_embeddings", "qk_norm", "zero_init", "unet_skips"):
            if not isinstance(getattr(self, name), bool):
                raise ScratchlmError(f"model.{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.norm_eps, int | float) and 0 < self.norm_eps < 1):
            raise ScratchlmError(f"model.norm_eps must lie in (0, 1), got {self.norm_eps!r}")
        if not self.logit_softcap >= 0:
            raise ScratchlmError(f"model.logit_softcap must be >= 0 (0: off), got {self.logit_softcap!r}")
        n = self.value_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= 2 * n <= self.num_layers:
            raise ScratchlmError(
                f"model.value_embeddings must be an integer from 0 to num_layers / 2 = {self.num_layers // 2} "
                f"(each table serves a block at each end), got {n!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def value_embedding_table(self, layer: int) -> int | None:
        """The value-embedding table block `layer` adds to its values, or None: tables 0 … n-1 serve the
        first n blocks and, in the same order, the last n."""
        n = self.value_embeddings
        if layer < n:
            return layer
        if layer >= self.num_layers - n:
            return layer - (self.num_layers - n)
        return None

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: `num_kv_heads`, or `num_heads` without grouped-query attention."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """The fields; `num_kv_heads` only under grouped-query attention, `attention` only when not "auto" and
        `norm_eps` only when not the default, so that other configs read and write exactly as before they
        existed (and a config or checkpoint without them loads with the default)."""
        values = dataclasses.asdict(self)
        if self.norm_eps == DEFAULT_NORM_EPS:
            del values["norm_eps"]
        if self.num_kv_heads is None:
            del values["num_kv_heads"]
        if self.attention == "auto":
            del values["attention"]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ScratchlmError(
                f"unknown model setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)


# Every linear matrix of a block (attention's four projections, the feed-forward's three): adapting all of
# them, rather than q and v alone as Hu et al. did, is what Dettmers et al. (QLoRA, 2023) found to match full
# fine-tuning.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")


BASE_DTYPES = ("auto", "bf16", "fp16", "fp32")  # lora.base_dtype's values
# What `lora.train` may name: the model's tables by their parameters' leading name.
TRAINABLE_TABLES = ("token_embeddings", "value_embeddings", "lm_head")


def default_lora_targets(model: ModelConfig) -> tuple[str, ...]:
    """What `lora.targets` is when not given: every matrix of `model`'s blocks (`DEFAULT_TARGETS`, less
    SwiGLU's gate `w3` where the feed-forward network has none: `ffn` silu or relu2, the fast recipe's), and
    the LM head where it is a matrix of its own. The head decides which token comes out; a frozen one is what
    held LoRA back most on a small base's conversations (docs/chat.md). A tied head is the embedding table,
    which an adapter on the head alone would untie, so it is not adapted."""
    blocks = tuple(t for t in DEFAULT_TARGETS if t != "w3" or model.ffn == "swiglu")
    return blocks if model.tie_embeddings else (*blocks, "lm_head")


@dataclass(frozen=True)
class LoRAConfig:
    """The `[lora]` section: which matrices get adapters, of what rank, and how they are scaled."""

    rank: int = 0  # r; 0: no adapters (full fine-tuning)
    alpha: float = 0.0  # α, the update is (α / r) B A; 0: 2 × rank (a scaling of 2 at every rank)
    # The blocks' Linear names adapted; a fine-tuning stage that is not given them takes every matrix its
    # base's blocks have (`default_lora_targets`).
    targets: tuple[str, ...] = DEFAULT_TARGETS
    # The frozen weights' storage (the compute dtype is the plan's): "auto" holds them in 16 bits, fp16 on an
    # fp16 plan and bf16 on the others (float32 too: each weight is upcast at use); "fp32" keeps them as read.
    base_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # Tables of the base trained whole beside the adapters (peft's `modules_to_save`): any of `TRAINABLE_TABLES`.
    train: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        """`α / r`."""
        return (self.alpha or 2.0 * self.rank) / self.rank

    def base_precision(self, precision: str) -> str:
        """The precision ("bf16", "fp16" or "fp32") the frozen weights are stored in on a plan computing in
        `precision` (resolved: "fp32", "bf16" or "fp16"). "auto" halves them whatever the plan: bf16 keeps
        float32's range (a weight cannot overflow), and on an fp16 plan fp16 is what the products take."""
        if self.base_dtype != "auto":
            return self.base_dtype
        return "fp16" if precision == "fp16" else "bf16"

    def check(self, source: str) -> None:
        if self.rank < 0:
            raise ScratchlmError(f"{source}: lora.rank must be >= 0 (0: no adapters), got {self.rank!r}")
        if self.alpha < 0:
            raise ScratchlmError(f"{source}: lora.alpha must be >= 0 (0: 2 × rank), got {self.alpha!r}")
        if self.rank and not self.targets:
            raise ScratchlmError(f"{source}: lora.targets is empty: name the blocks' matrices to adapt")
        unknown = [name for name in self.train if name not in TRAINABLE_TABLES]
        if unknown:
            raise ScratchlmError(
                f"{source}: lora.train names {unknown[0]!r}; it takes {', '.join(TRAINABLE_TABLES)}"
            )
        both = [name for name in self.train if name in self.targets]
        if self.rank and both:
            raise ScratchlmError(
                f"{source}: {both[0]!r} is in lora.targets and lora.train: a table trained whole needs no adapter"
            )
        if self.base_dtype not in BASE_DTYPES:
            raise ScratchlmError(
                f"{source}: lora.base_dtype must be one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}"
            )
