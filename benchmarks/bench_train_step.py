"""One training step of scratchlm against a torch.nn / torch.optim reference of the same architecture.

A step is: forward, cross-entropy, backward, gradient clipping at norm 1.0, AdamW update. scratchlm's side
uses `TransformerLM`, `cross_entropy`, `clip_grad_norm` and `AdamW`; the reference is built here from
`nn.Embedding`, `nn.Linear`, `nn.RMSNorm`, `F.scaled_dot_product_attention`, `F.silu`, `F.cross_entropy`,
`clip_grad_norm_` and `torch.optim.AdamW` (fused). Both start from the same weights, forward + loss are
`torch.compile`d for both, and the steps alternate (scratchlm, reference, scratchlm, ...) so that a machine
busy with other work slows both alike; the best step time of each side is reported (as `timeit` does: on a
shared machine the fastest run is the one least disturbed). On a CPU, denormal floats are flushed to zero for
both: AdamW's second moments of tiny gradients otherwise fall into the denormal range, where CPU arithmetic
is many times slower.

The model FLOPs of a step (3 × the forward matmul FLOPs, scratchlm.model.accounting) divided by the step time,
over the peak of a large matmul timed here in the same dtype, is the fraction of this machine's matmul peak
the step reaches (the MFU against a measured, rather than a datasheet, peak).

    python benchmarks/bench_train_step.py                       # CPU: batch 8 x 256, fp32 and bf16
    python benchmarks/bench_train_step.py --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from scratchlm import AdamW, ModelConfig, TransformerLM, clip_grad_norm, cross_entropy
from scratchlm.allocator import keep_freed_memory
from scratchlm.device import plan
from scratchlm.model.accounting import train_step_flops

# ---------------------------------------------------------------------------------------------- reference


class ReferenceRoPE(nn.Module):
    def __init__(self, theta: float, d_k: int, max_seq_len: int) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(max_seq_len), theta ** (-torch.arange(0, d_k, 2) / d_k))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class ReferenceBlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads = c.num_heads
        self.ln1, self.ln2 = nn.RMSNorm(c.d_model, eps=1e-5), nn.RMSNorm(c.d_model, eps=1e-5)
        self.attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "output_proj"):
            setattr(self.attn, name, nn.Linear(c.d_model, c.d_model, bias=False))
        self.ffn = nn.Module()
        self.ffn.w1 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.ffn.w2 = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.ffn.w3 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.rope = ReferenceRoPE(c.rope_theta, c.head_dim, c.context_length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            p(h).view(b, s, self.heads, -1).transpose(1, 2)
            for p in (self.attn.q_proj, self.attn.k_proj, self.attn.v_proj)
        )
        q, k = self.rope(q), self.rope(k)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.output_proj(attn.transpose(1, 2).reshape(b, s, d))
        h = self.ln2(x)
        return x + self.ffn.w2(F.silu(self.ffn.w1(h)) * self.ffn.w3(h))


class ReferenceLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.token_embeddings = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(ReferenceBlock(c) for _ in range(c.num_layers))
        self.ln_final = nn.RMSNorm(c.d_model, eps=1e-5)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embeddings(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_final(x))


def reference_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


# ---------------------------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of the best of a few `(n × n) @ (n × n)` matmuls: the practical peak the step is measured against."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


class TrainStep:
    """Forward + cross-entropy (compiled together; AOTAutograd compiles their backward too), backward,
    clipping at norm 1.0, optimizer update; the two halves timed separately."""

    def __init__(self, model, loss_fn, clip, optimizer, precision: str, device: torch.device, compile_: bool):
        self.model, self.clip, self.optimizer, self.device = model, clip, optimizer, device
        # Both sides run under the autocast of scratchlm's plan for `precision` (none for fp32).
        self.plan = plan(device, precision, threads=torch.get_num_threads())

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_fn(model(x), y)

        self.forward_loss = torch.compile(forward_loss) if compile_ else forward_loss

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """One step; returns (loss, seconds of forward + backward, seconds of clipping + update)."""
        sync(self.device)
        start = time.perf_counter()
        with self.plan.autocast():
            loss = self.forward_loss(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sync(self.device)
        middle = time.perf_counter()
        self.clip(self.model.parameters(), 1.0)
        self.optimizer.step()
        sync(self.device)
        return loss.item(), middle - start, time.perf_counter() - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-ff", type=int, default=1344)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--fused-reference", action="store_true", help="reference AdamW with fused=True")
    parser.add_argument("--peak-size", type=int, default=4096, help="matrix size of the peak measurement")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":
        # The CPU settings `scratchlm train` applies, for both sides alike (see scratchlm.allocator).
        torch.set_flush_denormal(True)
        keep_freed_memory()
    config = ModelConfig(
        vocab_size=args.vocab,
        context_length=args.context,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        d_ff=args.d_ff,
    )
    tokens = args.batch * args.context
    step_flops = train_step_flops(config, args.batch)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    compile_ = not args.no_compile
    threads = f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else ""
    print(
        f"device {device}{threads}, torch {torch.__version__}; d_model {config.d_model}, {config.num_layers} layers, "
        f"{config.num_heads} heads, d_ff {config.d_ff}, vocab {config.vocab_size}; batch {args.batch} x "
        f"{args.context}; {step_flops / 1e9:.1f} GFLOP per step; {'compiled' if compile_ else 'eager'}; "
        f"reference AdamW {'fused' if args.fused_reference else 'default'}; best of {args.steps} alternating steps"
    )
    header = f"{'precision':<9} {'side':<10} {'ms/step':>9} {'fwd+bwd':>9} {'clip+opt':>9} {'tokens/s':>10} {'of peak':>8} {'matmul peak':>15} {'loss':>7}"
    print(header)
    for precision in args.precision:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        peak = matmul_peak(device, dtype, args.peak_size)
        torch.manual_seed(0)
        ours = TransformerLM.from_config(config, device=device)
        reference = ReferenceLM(config).to(device)
        reference.load_state_dict(ours.state_dict())
        fused = {"fused": True} if args.fused_reference else {}
        steps = {
            "scratchlm": TrainStep(
                ours,
                cross_entropy,
                clip_grad_norm,
                AdamW(ours.parameters(), **hyper),
                precision,
                device,
                compile_,
            ),
            "reference": TrainStep(
                reference,
                reference_loss,
                torch.nn.utils.clip_grad_norm_,
                torch.optim.AdamW(reference.parameters(), **hyper, **fused),
                precision,
                device,
                compile_,
            ),
        }
        generator = torch.Generator().manual_seed(1)
        batch = torch.randint(0, config.vocab_size, (args.batch, args.context + 1), generator=generator).to(
            device
        )
        x, y = batch[:, :-1], batch[:, 1:]
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in steps}
        for i in range(args.warmup + args.steps):
            for name, step in steps.items():  # alternating, so that outside load hits both sides alike
                result = step(x, y)
                if i >= args.warmup:
                    runs[name].append(result)
        totals = {}
        for name, results in runs.items():
            totals[name] = total = min(r[1] + r[2] for r in results)
            model_s, update_s = (min(r[k] for r in results) for k in (1, 2))
            print(
                f"{precision:<9} {name:<10} {total * 1e3:>9.1f} {model_s * 1e3:>9.1f} {update_s * 1e3:>9.1f} "
                f"{tokens / total:>10,.0f} {step_flops / total / peak:>8.1%} {peak / 1e9:>7.0f} GFLOP/s "
                f"{results[-1][0]:>7.3f}"
            )
        ratio = totals["reference"] / totals["scratchlm"]
        print(
            f"{precision:<9} {'ratio':<10} {ratio:>9.3f}  reference time / scratchlm time (>= 1: scratchlm faster)"
        )


if __name__ == "__main__":
    main()
