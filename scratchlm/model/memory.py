"""Training memory per process under data parallelism (DDP) and fully sharded data parallelism (FSDP), with
and without activation checkpointing: what `scratchlm doctor --world N` prints.

Built on `scratchlm.model.accounting` (the parameter count per component and the activation values saved per
sequence), with the project's training as it runs:

- **State.** Training keeps float32 master weights whatever the precision (bf16 and fp16 are autocast over
  them), so parameters and gradients take 4 bytes each. The optimizer adds float32 tensors of the parameters'
  shapes: AdamW two moments (8 bytes a parameter); Muon one momentum buffer for the blocks' matrices and
  AdamW's two moments for the rest (embeddings, head, gains); SGD none (its step count is a Python number).
  These three are exact: the tests compare them with the bytes of a real model's and optimizer's tensors.
- **DDP** keeps the whole state on every process, and nothing more: the reducer all-reduces the gradients
  through flat buckets, and the gradients are views into them (`gradient_as_bucket_view`,
  scratchlm/parallel/ddp.py), not a second copy of every gradient (4 bytes a parameter more without it).
- **FSDP** keeps 1/N of the state on each of N processes (each parameter's first dimension is split; the few
  rows of padding that make it divisible are left out). During the forward and backward passes a process also
  holds gathered weights, in the compute dtype, and their unsharded gradients until they are reduce-scattered:
  those of the root (the embeddings, value embeddings, head and final gain, which stay gathered for the whole
  step) and those of one block at a time.
- **Activations** are those of one micro-batch, `batch_size / N / grad_accum` sequences, each saving the
  values `accounting.activation_elements` lists, at 2 bytes under bf16 or fp16 and 4 under fp32. That list is
  the CS336 assignment-1 handout's: it counts every logit and two `L × L` attention matrices, where the fused
  loss and the blockwise attention keep less, so it is an upper estimate. With activation checkpointing a block keeps only
  its input (the float32 residual stream, `d_model` values a token) and recomputes the rest in the backward
  pass: the micro-batch holds every block's input, one block's activations at a time, and the head's.

A world of one is one process: nothing sharded, whatever the parallelism. Sizes are bytes.

**LoRA** (`lora_memory`, `scratchlm.model.lora`) trains two thin float32 matrices beside each adapted matrix
`W (d_out × d_in)` of the blocks, `A (r × d_in)` and `B (d_out × r)`, and freezes the rest. The frozen
parameters are weights only (no gradients, no optimizer state): the matrices (the blocks', the embedding
tables, the head) in `lora.base_dtype`'s storage (2 bytes under "auto", on a float32 plan too: `apply_lora`'s
`base_dtype`), the gains in float32.
The adapters have float32 gradients and AdamW's two moments (under Muon too: they are not orthogonalised; none
under SGD). Their activations are the handout's list plus `x Aᵀ`, the r values a token each adapter keeps for
B's gradient (its input `x` is already on the list, as the input of the matrix it adapts). LoRA runs use DDP,
whose buckets are the gradients, so there are no buffers. Left out: the embedding tables a fine-tuning stage
grows for chat tokens its base lacked, which then train too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from scratchlm.errors import ScratchlmError
from scratchlm.model.accounting import BYTES_FP32, activation_elements, parameter_counts
from scratchlm.model.config import LoRAConfig, ModelConfig

PARALLELS = ("ddp", "fsdp")
#: The order `suggest` prefers among the layouts that fit: without recomputation first (checkpointing costs
#: about a third more compute), and at either, DDP's one all-reduce a step before FSDP's gathers.
PREFERENCE = (("ddp", False), ("fsdp", False), ("ddp", True), ("fsdp", True))
#: The share of a device's memory an estimate may fill and still fit: the rest is for what it leaves out (the
#: allocator's fragmentation, CUDA's context, the temporaries of kernels and of the optimizer step).
HEADROOM = 0.9
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_TENSORS = {"adamw": 2, "sgd": 0}  # float32 state tensors per parameter (Muon: `optimizer_elements`)
MATRIX_COMPONENTS = ("attention (W_Q, W_K, W_V, W_O)", "feed-forward")  # the "matrices" parameter group
HEAD_ACTIVATIONS = ("final RMSNorm", "logits + cross-entropy")  # outside the blocks
GAINS = ("RMSNorm gains", "U-net skip weights")  # vectors a LoRA base keeps in float32 (the rest are tables)
# `lora.train`'s tables by their names in `parameter_counts`
TABLES = {
    "token_embeddings": "token embeddings",
    "value_embeddings": "value embeddings",
    "lm_head": "LM head",
}


@dataclass(frozen=True)
class ParameterSplit:
    """How `fully_shard` sees the parameters: `layers` blocks of `block` each, and the root, the rest.
    `matrices` are the blocks' weight matrices (Muon's group)."""

    total: int
    block: int
    layers: int
    matrices: int

    @property
    def root(self) -> int:
        return self.total - self.layers * self.block


def parameter_split(config: ModelConfig) -> ParameterSplit:
    counts = parameter_counts(config)
    matrices = sum(counts[name] for name in MATRIX_COMPONENTS)
    norms = 2 * config.d_model if config.norm != "none" else 0
    qk_norms = 2 * config.head_dim if config.qk_norm else 0
    block = matrices // config.num_layers + norms + qk_norms
    return ParameterSplit(sum(counts.values()), block, config.num_layers, matrices)


def optimizer_elements(split: ParameterSplit, optimizer: str) -> int:
    """Values of the optimizer's state tensors for the whole model (see the module docstring)."""
    if optimizer == "muon":
        return split.matrices + 2 * (split.total - split.matrices)
    if optimizer not in OPTIMIZER_TENSORS:
        raise ScratchlmError(f"no memory estimate for optimizer {optimizer!r} (known: adamw, muon, sgd)")
    return OPTIMIZER_TENSORS[optimizer] * split.total


def micro_batch(batch_size: int, world: int, grad_accum: int) -> int:
    """Sequences in one process's micro-batch; the batch must split evenly, as training requires."""
    if world < 1:
        raise ScratchlmError(f"the number of processes must be at least 1, got {world}")
    if batch_size % (world * grad_accum):
        raise ScratchlmError(
            f"training.batch_size ({batch_size}) must be divisible by processes × grad_accum "
            f"({world} × {grad_accum})"
        )
    return batch_size // world // grad_accum


def activation_bytes(config: ModelConfig, sequences: int, precision: str, checkpointing: bool) -> int:
    """What the backward pass of a micro-batch of `sequences` keeps (see the module docstring)."""
    size = COMPUTE_BYTES[precision]
    elements = activation_elements(config, sequences)
    head = sum(elements[name] for name in HEAD_ACTIVATIONS)
    blocks = sum(elements.values()) - head
    if not checkpointing:
        return (blocks + head) * size
    inputs = config.num_layers * sequences * config.context_length * config.d_model * BYTES_FP32
    return inputs + (blocks // config.num_layers + head) * size


@dataclass(frozen=True)
class RankMemory:
    """The bytes one process holds at the peak of a training step."""

    parallel: str | None  # "ddp" | "fsdp"; None for a world of one
    world: int
    checkpointing: bool
    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int  # FSDP: gathered weights and their unsharded gradients; DDP: none (its buckets are them)
    activations: int

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.state + self.buffers + self.activations

    @property
    def layout(self) -> str:
        """How it runs, in words: "4 processes, fsdp, activation checkpointing"."""
        processes = f"{self.world} process{'es' if self.world > 1 else ''}"
        parts = [processes] + ([self.parallel] if self.parallel else [])
        return ", ".join(parts + (["activation checkpointing"] if self.checkpointing else []))


def rank_memory(
    config: ModelConfig,
    optimizer: str,
    precision: str,
    batch_size: int,
    grad_accum: int,
    world: int,
    parallel: str,
    checkpointing: bool,
) -> RankMemory:
    """The estimate for one process of `world` training `config` with `optimizer` ("adamw", "muon", "sgd")
    at the resolved `precision` ("fp32", "bf16", "fp16"), the global batch `batch_size` in `grad_accum`
    micro-batches, under `parallel` ("ddp" or "fsdp"; ignored for a world of one)."""
    if parallel not in PARALLELS:
        raise ScratchlmError(f"parallel must be one of {', '.join(PARALLELS)}, got {parallel!r}")
    sequences = micro_batch(batch_size, world, grad_accum)
    split = parameter_split(config)
    shards = world if parallel == "fsdp" else 1
    params, moments = (math.ceil(n / shards) for n in (split.total, optimizer_elements(split, optimizer)))
    buffers = 0  # DDP's buckets are its gradients (`gradient_as_bucket_view`): nothing beyond the state
    if world > 1 and parallel == "fsdp":
        buffers = (split.root + split.block) * 2 * COMPUTE_BYTES[precision]
    return RankMemory(
        parallel=parallel if world > 1 else None,
        world=world,
        checkpointing=checkpointing,
        parameters=params * BYTES_FP32,
        gradients=params * BYTES_FP32,
        optimizer_state=moments * BYTES_FP32,
        buffers=buffers,
        activations=activation_bytes(config, sequences, precision, checkpointing),
    )


def block_matrices(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The weight matrices of a block by their names in the model (LoRA's targets), as `(d_out, d_in)`."""
    d, d_ff, d_kv = config.d_model, config.d_ff, config.kv_heads * config.head_dim
    attention = {"q_proj": (d, d), "k_proj": (d_kv, d), "v_proj": (d_kv, d), "output_proj": (d, d)}
    gate = {"w3": (d_ff, d)} if config.ffn == "swiglu" else {}
    return attention | {"w1": (d_ff, d), "w2": (d, d_ff)} | gate


def lora_memory(
    config: ModelConfig,
    lora: LoRAConfig,
    optimizer: str,
    precision: str,
    batch_size: int,
    grad_accum: int,
    world: int,
    checkpointing: bool,
) -> RankMemory:
    """The estimate for one process of `world` training LoRA adapters (`lora`) on a frozen `config`, the
    other arguments as `rank_memory`'s (see the module docstring)."""
    matrices = block_matrices(config)
    unknown = [t for t in lora.targets if t not in matrices and t != "lm_head"]
    if unknown:
        raise ScratchlmError(
            f"lora.targets: the blocks have no matrix {unknown[0]!r}; theirs are {', '.join(matrices)}"
        )
    adapted = [shape for name, shape in matrices.items() if name in lora.targets]
    head = "lm_head" in lora.targets  # (vocab, d): r (vocab + d) more, x Aᵀ once
    full = rank_memory(config, optimizer, precision, batch_size, grad_accum, world, "ddp", checkpointing)
    split = parameter_split(config)
    adapters = config.num_layers * lora.rank * sum(d_out + d_in for d_out, d_in in adapted)
    adapters += head * lora.rank * (config.vocab_size + config.d_model)
    counts = parameter_counts(config)
    whole = sum(counts[TABLES[name]] for name in lora.train if TABLES[name] in counts)  # trained in float32
    gains = sum(n for name, n in counts.items() if name in GAINS)
    stored = COMPUTE_BYTES[lora.base_precision(precision)]
    frozen = (split.total - gains - whole) * stored + gains * BYTES_FP32
    trained = adapters + whole
    moments = 0 if optimizer == "sgd" else OPTIMIZER_TENSORS["adamw"]
    # x Aᵀ of every adapted matrix; under checkpointing, of the one block recomputed at a time
    tokens = micro_batch(batch_size, world, grad_accum) * config.context_length
    blocks = 1 if checkpointing else config.num_layers
    low_rank = (blocks * len(adapted) + head) * tokens * lora.rank * COMPUTE_BYTES[precision]
    return replace(
        full,
        parameters=frozen + trained * BYTES_FP32,
        gradients=trained * BYTES_FP32,
        optimizer_state=moments * trained * BYTES_FP32,
        activations=full.activations + low_rank,
    )


def layouts(world: int) -> Iterator[tuple[str, bool]]:
    """The (parallel, checkpointing) pairs worth comparing at `world`: both parallelisms only when there are
    several processes, in the order of `PREFERENCE`."""
    if world > 1:
        return iter(PREFERENCE)
    return iter([("ddp", False), ("ddp", True)])  # one process: the parallelism is ignored


@dataclass(frozen=True)
class MemoryBudget:
    """A device's memory, and whether the processes of one machine share it (a CPU's RAM) or each has its own
    (one GPU per process)."""

    bytes: int
    what: str  # e.g. "GPU memory of NVIDIA H100 80GB HBM3", "available RAM"
    shared: bool

    def fits(self, estimate: RankMemory) -> bool:
        """Within `HEADROOM` of the memory: the whole world's on a shared one (every process on this machine),
        one process's on its own device."""
        processes = estimate.world if self.shared else 1
        return processes * estimate.total <= HEADROOM * self.bytes


@dataclass(frozen=True)
class Suggestion:
    estimate: RankMemory | None  # the preferred layout that fits; None if none does up to `largest_world`
    largest_world: int  # the most processes the batch allows (searched when nothing fits at the given world)


def suggest(
    config: ModelConfig,
    optimizer: str,
    precision: str,
    batch_size: int,
    grad_accum: int,
    world: int,
    budget: MemoryBudget,
) -> Suggestion:
    """The first layout of `PREFERENCE` that fits at `world`; if none does, the fewest processes beyond it at
    which one does (the batch must divide among them, so at most `batch_size / grad_accum`)."""
    largest = batch_size // grad_accum
    beyond = [n for n in range(world + 1, largest + 1) if batch_size % (n * grad_accum) == 0]
    for processes in [world, *beyond]:
        for parallel, checkpointing in layouts(processes):
            estimate = rank_memory(
                config, optimizer, precision, batch_size, grad_accum, processes, parallel, checkpointing
            )
            if budget.fits(estimate):
                return Suggestion(estimate, largest)
    return Suggestion(None, largest)
