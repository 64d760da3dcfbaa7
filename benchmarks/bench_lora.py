"""LoRA against full fine-tuning: the training state each keeps, and the tokens a second of its steps.

The model has SmolLM-135M's shape (30 layers, d_model 576, 9 heads over 3 KV heads, d_ff 1536, vocabulary
49,152, tied embeddings), with random weights: memory and speed depend on the shapes, not the values. Each
side is the run's own step: forward, cross-entropy, backward, clipping at norm 1, the AdamW of
`build_optimizer` over the parameter groups the model declares (every parameter for full fine-tuning; the
adapters alone for LoRA, `scratchlm.model.lora.apply_lora` on all seven matrices of every block). LoRA runs
twice: its frozen base stored in float32 (`lora.base_dtype = "fp32"`) and in bfloat16 (`"bf16"`, what "auto"
chooses on this float32 plan), computing in float32 either way.

Training state = the parameters (all of them, frozen ones too, in the dtype they are stored in) + the gradients of the trainable
ones + the optimizer's state, counted from the tensors after a step. Speed: the steps alternate (full, LoRA,
full, ...) so that a busy machine slows both alike, and the best step of each is reported.

    python benchmarks/bench_lora.py                    # rank 16, batch 1 x 128 tokens, 3 timed steps each
    python benchmarks/bench_lora.py --rank 8 --seq 256 --steps 5
"""

from __future__ import annotations

import argparse
import time

import torch

from scratchlm.allocator import keep_freed_memory
from scratchlm.model.config import LoRAConfig, ModelConfig
from scratchlm.model.lora import Adapters, apply_lora, storage_dtype
from scratchlm.model.loss import cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.training.grad import clip_grad_norm
from scratchlm.training.optimizers import OptimizerConfig, build_optimizer

SMOLLM_135M = ModelConfig(
    vocab_size=49_152,
    context_length=2048,
    d_model=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    d_ff=1536,
    tie_embeddings=True,
)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state, in bytes (a tied matrix once)."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def step(model: TransformerLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One training step; its seconds."""
    start = time.perf_counter()
    loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    clip_grad_norm([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # gradients kept, as the run keeps their memory between steps
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each, after one warm-up step")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    keep_freed_memory()
    torch.manual_seed(0)
    full = TransformerLM(SMOLLM_135M)
    settings = OptimizerConfig(lr=1e-4, weight_decay=0.0)
    sides = {"full": (full, build_optimizer(settings, full))}
    for stored in ("fp32", "bf16"):
        lora = TransformerLM(SMOLLM_135M)
        lora.load_state_dict(full.state_dict())
        config = LoRAConfig(args.rank, base_dtype=stored)
        apply_lora(lora, Adapters(config), base_dtype=storage_dtype(config, torch.float32))
        sides[f"LoRA r{args.rank} {stored}"] = (lora, build_optimizer(settings, lora))
    ids = torch.randint(0, SMOLLM_135M.vocab_size, (args.batch, args.seq + 1))
    best = {name: float("inf") for name in sides}
    for i in range(args.steps + 1):
        for name, (model, optimizer) in sides.items():
            seconds = step(model, optimizer, ids)
            best[name] = min(best[name], seconds) if i else best[name]  # the first step warms up
    tokens = args.batch * args.seq
    print(
        f"{torch.get_num_threads()} threads, batch {args.batch} x {args.seq} tokens, fp32, best of {args.steps}"
    )
    print(
        f"{'':17} {'trainable':>12} {'state MB':>10} {'step s':>8} {'tokens/s':>9} {'state/full':>10} {'rate/full':>9}"
    )
    full_bytes, full_rate = state_bytes(*sides["full"]), tokens / best["full"]
    for name, (model, optimizer) in sides.items():
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        size, rate = state_bytes(model, optimizer), tokens / best[name]
        print(
            f"{name:17} {trainable:>12,} {size / 1e6:>10.1f} {best[name]:>8.3f} {rate:>9.1f}"
            f" {size / full_bytes:>9.3f}x {rate / full_rate:>8.2f}x"
        )


if __name__ == "__main__":
    main()
