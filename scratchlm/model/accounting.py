"""Resource accounting: parameters, FLOPs and training memory of a `ModelConfig`, from formulas.

Conventions (those of the CS336 assignment-1 handout):

- A matrix multiply `(m × n) @ (n × p)` costs `2 m n p` FLOPs (one multiply and one add per term). Only matrix
  multiplies are counted; normalisation, softmax, RoPE and the residual additions are O(seq · d_model) each,
  negligible next to them.
- The backward pass costs twice the forward (a matmul's gradient needs two matmuls of the same size: one for
  the input's gradient, one for the weight's), so a training step costs 3 × the forward FLOPs. AdamW's
  update is a few element-wise operations per parameter, a rounding error next to that.
- Training keeps everything in float32 (4 bytes): parameters, gradients, and AdamW's two moment estimates
  (`m` and `v`), i.e. 16 bytes per parameter, plus the activations the backward pass needs.
- Activations follow the handout's list, one tensor saved per entry: per block, the outputs of both RMSNorms,
  of the Q/K/V projections, `Q Kᵀ`, the softmax, the weighted sum of values, the output projection and of
  each step of the feed-forward network (W1, SiLU, W2; for SwiGLU also W3 and the gating product, which the
  backward pass needs as well); then the final RMSNorm, the logits and the cross-entropy's probabilities.

`scratchlm accounting` (scratchlm/cli/accounting.py) prints these as tables; the tests check the parameter
count against `sum(p.numel())` of a real model and the forward FLOPs against torch's FLOP counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from scratchlm.model.config import ModelConfig

BYTES_FP32 = 4

#: The GPT-2 shapes of the handout: vocab 50,257, context 1,024, d_ff = 4 d_model (SwiGLU, as the handout's model).
GPT2_PRESETS: dict[str, ModelConfig] = {
    name: ModelConfig(
        vocab_size=50_257,
        context_length=1_024,
        num_layers=layers,
        d_model=d_model,
        num_heads=heads,
        d_ff=4 * d_model,
    )
    for name, layers, d_model, heads in (
        ("gpt2-small", 12, 768, 12),
        ("gpt2-medium", 24, 1_024, 16),
        ("gpt2-large", 36, 1_280, 20),
        ("gpt2-xl", 48, 1_600, 25),
    )
}

# The groups a forward pass's matmuls are reported in.
ATTENTION_PROJECTIONS = "attention projections"
ATTENTION_SCORES = "attention scores + weighted sum"
FEED_FORWARD = "feed-forward"
LM_HEAD = "LM head"
COMPONENTS = (ATTENTION_PROJECTIONS, ATTENTION_SCORES, FEED_FORWARD, LM_HEAD)


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Trainable parameters per component; they sum to `TransformerLM.num_parameters()`.

    Token embeddings `V d`; per block: attention `4 d²` (W_Q, W_K, W_V, W_O; W_K and W_V have `d_kv =
    num_kv_heads · d_k` rows, so `2 d² + 2 d d_kv` under grouped-query attention), feed-forward `3 d d_ff` (SwiGLU:
    W1, W2, W3) or `2 d d_ff` (SiLU, ReLU²: W1, W2), RMSNorm gains `2 d` (none without norms) plus `2 d_k`
    with QK-norm; a final RMSNorm gain `d` (pre-norm only); the LM head `V d`, unless tied to the embeddings;
    with the fast recipe's switches, `n V d_kv` for n value-embedding tables and `L / 2` U-net skip weights
    (listed only when present)."""
    d, layers = config.d_model, config.num_layers
    ffn_matrices = 3 if config.ffn == "swiglu" else 2
    extras = {
        "value embeddings": config.value_embeddings * config.vocab_size * config.kv_heads * config.head_dim,
        "U-net skip weights": layers // 2 if config.unet_skips else 0,
    }
    return {
        "token embeddings": config.vocab_size * d,
        "attention (W_Q, W_K, W_V, W_O)": layers * (2 * d * d + 2 * d * config.kv_heads * config.head_dim),
        "feed-forward": layers * ffn_matrices * d * config.d_ff,
        "RMSNorm gains": (layers * 2 * d if config.norm != "none" else 0)
        + (d if config.norm == "pre" else 0)
        + (layers * 2 * config.head_dim if config.qk_norm else 0),
        "LM head": 0 if config.tie_embeddings else config.vocab_size * d,
    } | {name: count for name, count in extras.items() if count}


def num_parameters(config: ModelConfig) -> int:
    return sum(parameter_counts(config).values())


@dataclass(frozen=True)
class Matmul:
    """`count` matrix multiplies `(m × n) @ (n × p)` of one forward pass, each costing `2 m n p` FLOPs."""

    component: str
    name: str
    m: int
    n: int
    p: int
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.p * self.count


def forward_matmuls(config: ModelConfig, seq_len: int | None = None, batch_size: int = 1) -> list[Matmul]:
    """Every matmul of one forward pass over `batch_size` sequences of `seq_len` tokens (default: the
    context length), in the order they run. Projections multiply all `batch · seq` token vectors by a weight
    matrix; attention runs per sequence and head: `Q Kᵀ` is `(seq × d_k)(d_k × seq)` and the weighted sum
    `(seq × seq)(seq × d_k)`, i.e. quadratic in the sequence length. These are the model's FLOPs as the
    handout counts them, the whole score matrix included; `causal_attention` computes only the blocks of it
    that the causal mask leaves visible (about `(1 + 64 / seq) / 2` of it). MFU figures computed from this
    count include the skipped part, as is the usual convention."""
    seq = config.context_length if seq_len is None else seq_len
    d, d_ff, d_k, layers = config.d_model, config.d_ff, config.head_dim, config.num_layers
    tokens, heads = batch_size * seq, batch_size * config.num_heads * layers
    d_kv = config.kv_heads * d_k  # grouped-query attention: fewer key/value heads, as many scores
    matmuls = [
        Matmul(ATTENTION_PROJECTIONS, "Q projection  x W_Qᵀ", tokens, d, d, layers),
        Matmul(ATTENTION_PROJECTIONS, "K projection  x W_Kᵀ", tokens, d, d_kv, layers),
        Matmul(ATTENTION_PROJECTIONS, "V projection  x W_Vᵀ", tokens, d, d_kv, layers),
        Matmul(ATTENTION_SCORES, "scores  Q Kᵀ", seq, d_k, seq, heads),
        Matmul(ATTENTION_SCORES, "weighted sum  softmax(·) V", seq, seq, d_k, heads),
        Matmul(ATTENTION_PROJECTIONS, "output projection  W_Oᵀ", tokens, d, d, layers),
        Matmul(FEED_FORWARD, "W1", tokens, d, d_ff, layers),
    ]
    if config.ffn == "swiglu":
        matmuls.append(Matmul(FEED_FORWARD, "W3 (gate)", tokens, d, d_ff, layers))
    matmuls += [
        Matmul(FEED_FORWARD, "W2", tokens, d_ff, d, layers),
        Matmul(LM_HEAD, "LM head  x W_headᵀ", tokens, d, config.vocab_size, 1),
    ]
    return matmuls


def forward_flops(config: ModelConfig, seq_len: int | None = None, batch_size: int = 1) -> int:
    return sum(m.flops for m in forward_matmuls(config, seq_len, batch_size))


def flops_by_component(
    config: ModelConfig, seq_len: int | None = None, batch_size: int = 1
) -> dict[str, int]:
    totals = dict.fromkeys(COMPONENTS, 0)
    for matmul in forward_matmuls(config, seq_len, batch_size):
        totals[matmul.component] += matmul.flops
    return totals


def train_step_flops(config: ModelConfig, batch_size: int, seq_len: int | None = None) -> int:
    """One AdamW step: forward + backward (twice the forward) = 3 × the forward FLOPs (handout convention)."""
    return 3 * forward_flops(config, seq_len, batch_size)


def flops_per_token(config: ModelConfig) -> int:
    """Training FLOPs per token of a full-context sequence: forward + backward of every matmul (the
    handout's 3 × forward count, attention scores included). The numerator of the MFU estimate."""
    return train_step_flops(config, batch_size=1) // config.context_length


def activation_elements(config: ModelConfig, batch_size: int, seq_len: int | None = None) -> dict[str, int]:
    """Activation values saved for the backward pass, per group of the handout's list (see the module
    docstring). Linear in the batch size; the attention matrices are quadratic in the sequence length."""
    seq = config.context_length if seq_len is None else seq_len
    d, d_ff, layers = config.d_model, config.d_ff, config.num_layers
    d_kv = config.kv_heads * config.head_dim
    tokens = batch_size * seq
    norms = 2 if config.norm != "none" else 0
    ffn_tensors = 4 if config.ffn == "swiglu" else 2  # W1, (W3,) SiLU or ReLU², (product) at d_ff; W2 at d
    return {
        "RMSNorm outputs": layers * norms * tokens * d,
        # Q at d, K and V at num_kv_heads · d_k; + normalised Q, K
        "Q, K, V projections": layers * tokens * (d + 2 * d_kv + (d + d_kv if config.qk_norm else 0)),
        "attention scores Q Kᵀ + softmax": layers * 2 * batch_size * config.num_heads * seq * seq,
        "weighted sum + output projection": layers * 2 * tokens * d,
        "feed-forward": layers * (ffn_tensors * tokens * d_ff + tokens * d),
        "final RMSNorm": tokens * d if config.norm == "pre" else 0,
        # the soft-capped logits are a second logits tensor
        "logits + cross-entropy": (3 if config.logit_softcap else 2) * tokens * config.vocab_size,
    }


@dataclass(frozen=True)
class TrainingMemory:
    """Peak float32 memory of AdamW training, in bytes: `fixed + per_sequence × batch_size`."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations_per_sequence: int

    @property
    def fixed(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def total(self, batch_size: int) -> int:
        return self.fixed + self.activations_per_sequence * batch_size

    def max_batch_size(self, memory_bytes: float) -> int:
        """The largest batch whose peak memory fits in `memory_bytes` (0 if not even the weights fit)."""
        return max(0, int((memory_bytes - self.fixed) // self.activations_per_sequence))


def training_memory(config: ModelConfig, seq_len: int | None = None) -> TrainingMemory:
    """Parameters, gradients (one per parameter) and AdamW's `m` and `v` (two per parameter) take
    `4 + 4 + 8 = 16` bytes per parameter; activations 4 bytes per saved value."""
    params = num_parameters(config)
    per_sequence = sum(activation_elements(config, 1, seq_len).values())
    return TrainingMemory(
        parameters=BYTES_FP32 * params,
        gradients=BYTES_FP32 * params,
        optimizer_state=2 * BYTES_FP32 * params,
        activations_per_sequence=BYTES_FP32 * per_sequence,
    )


def training_days(total_flops: float, peak_flops_per_s: float, mfu: float) -> float:
    """Wall-clock days at a model FLOPs utilisation `mfu` (the fraction of the peak that goes into the
    model's FLOPs as counted above)."""
    return total_flops / (mfu * peak_flops_per_s) / 86_400
