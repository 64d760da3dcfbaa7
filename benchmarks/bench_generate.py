"""Generation throughput with and without the KV cache, side by side, at the TinyStories model of the CS336 assignment-1 handout.

The model (vocab 10,000, context 256, d_model 512, 4 layers, 16 heads, d_ff 1,344) has random weights: the cost
of a token does not depend on what the weights are. Both paths generate the same number of new tokens from the
same prompt with greedy decoding, and the benchmark checks that they produce the same tokens. Without the cache
each new token reruns the model over the whole sequence so far (up to the context length); with it the prompt
is run once and each new token costs one position.

    python benchmarks/bench_generate.py                    # 256 new tokens after a 4-token prompt, CPU
    python benchmarks/bench_generate.py --new-tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from scratchlm.generation.generate import generate
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


if __name__ == "__main__":
    main()
