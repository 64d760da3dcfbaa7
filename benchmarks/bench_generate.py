"""Generation throughput with and without the KV cache, side by side, at the TinyStories model of the CS336 assignment-1 handout.

The model (vocab 10,000, context 256, d_model 512, 4 layers, 16 heads, d_ff 1,344) has random weights: the cost
of a token does not depend on what the weights are. Both paths generate the same number of new tokens from the
same prompt with greedy decoding, and the benchmark checks that they produce the same tokens. Without the cache
each new token reruns the model over the whole sequence so far (up to the context length); with it the prompt
is run once and each new token costs one position.

Then decoding at batch 1 with the weights held in bf16, as `generate`, `eval` and `serve` hold them where the
resolved precision is bf16 (`prepare_for_inference`), against float32 weights: plain fp32 (also prepared by
`prepare_for_inference`: each precision runs a token times a matrix the way measured fastest for it,
`Plan.matvec`), and cast to bf16 at every matmul under autocast (how inference ran before). These rows decode while the
sequence fits the context (no recomputation over a full window). Decoding one token reads every weight once,
so its speed is bound by memory bandwidth; each row also shows that bound: the `scratchlm doctor` bandwidth
over the bytes of weights one token reads (every matrix, one row of each embedding table).

    python benchmarks/bench_generate.py                    # 256 new tokens after a 4-token prompt, CPU
    python benchmarks/bench_generate.py --new-tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from scratchlm.device import device_profile, plan
from scratchlm.generation.generate import generate
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM


def timed_generate(
    model: TransformerLM, prompt: list[int], new_tokens: int, use_cache: bool
) -> tuple[list[int], float]:
    start = time.perf_counter()
    tokens = generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--prompt-tokens", type=int, default=4, help="prompt length (e.g. 'Once upon a time')"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--rounds", type=int, default=5, help="turns of the weight-dtype comparison (best of)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = ModelConfig()  # the TinyStories model of the specification
    model = TransformerLM.from_config(config, device=args.device).eval()
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,)).tolist()
    print(
        f"TinyStories model: {model.num_parameters():,} parameters "
        f"({model.num_parameters(non_embedding=True):,} non-embedding), context {config.context_length}; "
        f"{args.new_tokens} new tokens after a {args.prompt_tokens}-token prompt; device {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    timed_generate(model, prompt, 8, use_cache=True)  # warm-up: allocator, kernels
    cached, cached_s = timed_generate(model, prompt, args.new_tokens, use_cache=True)
    full, full_s = timed_generate(model, prompt, args.new_tokens, use_cache=False)

    rows = [("without KV cache (recompute)", full_s), ("with KV cache", cached_s)]
    print(f"{'path':<30} {'seconds':>9} {'tokens/s':>10}")
    for name, seconds in rows:
        print(f"{name:<30} {seconds:>9.2f} {args.new_tokens / seconds:>10.1f}")
    print(f"speed-up with the cache: {full_s / cached_s:.1f}x (target >= 5x)")
    print(f"same tokens on both paths: {'yes' if cached == full else 'NO'}")
    compare_weight_dtypes(config, prompt, args)


def weight_bytes_per_token(model: TransformerLM) -> int:
    """Bytes of weights one decoded token reads: every parameter, except that an embedding table (not tied to
    the head) gives one row."""
    tables = [model.token_embeddings.weight] if not model.config.tie_embeddings else []
    tables += [] if model.value_embeddings is None else [t.weight for t in model.value_embeddings]
    table_ids = {id(t) for t in tables}
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in table_ids)
    return total + sum(t.shape[1] * t.element_size() for t in tables)


def compare_weight_dtypes(config: ModelConfig, prompt: list[int], args: argparse.Namespace) -> None:
    """Batch-1 decoding with the KV cache: bf16 weights against float32 ones, in the same run."""
    device = torch.device(args.device)
    bandwidth = device_profile(device).memory_gbps * 1e9

    def model_in(precision: str) -> TransformerLM:
        torch.manual_seed(0)
        model = TransformerLM.from_config(config, device=device)
        return prepare_for_inference(model, plan(device, precision, threads=torch.get_num_threads()))

    fp32, bf16 = model_in("fp32"), model_in("bf16")
    # Decoding proper: past the context, generation recomputes a whole window at every step.
    new_tokens = min(args.new_tokens, config.context_length - len(prompt))
    rows: list[tuple[str, TransformerLM, bool]] = [
        ("fp32 weights, fp32", fp32, False),
        ("fp32 weights, bf16 autocast", fp32, True),
        ("bf16 weights (prepare_for_inference)", bf16, False),
    ]
    ways = ", ".join(f"{name} {plan(device, name).matvec.value}" for name in ("fp32", "bf16"))
    print(
        f"\ndecoding at batch 1, {new_tokens} tokens; bandwidth {bandwidth / 1e9:.1f} GB/s (doctor); "
        f"a token times a matrix: {ways}"
    )
    print(f"{'weights':<30} {'tokens/s':>9} {'MB/token':>9} {'bound':>9} {'of bound':>9}")
    best = {name: math.inf for name, _, _ in rows}
    for _ in range(args.rounds):  # in turns, so that a slow spell of a shared machine hits every row alike
        for name, model, autocast in rows:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                timed_generate(model, prompt, 8, use_cache=True)
                seconds = timed_generate(model, prompt, new_tokens, use_cache=True)[1]
            best[name] = min(best[name], seconds)
    rates = {}
    for name, model, _ in rows:
        rate = new_tokens / best[name]
        per_token = weight_bytes_per_token(model)
        bound = bandwidth / per_token
        rates[name] = rate
        print(f"{name:<30} {rate:>9.1f} {per_token / 1e6:>9.1f} {bound:>9.1f} {rate / bound:>9.0%}")
    bf16_rate = rates["bf16 weights (prepare_for_inference)"]
    print(
        f"bf16 weights: {bf16_rate / rates['fp32 weights, fp32']:.2f}x fp32 weights (target >= 1.6x), "
        f"{bf16_rate / rates['fp32 weights, bf16 autocast']:.2f}x fp32 weights under bf16 autocast"
    )


if __name__ == "__main__":
    main()
