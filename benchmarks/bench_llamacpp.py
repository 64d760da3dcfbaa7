"""Decoding on a CPU, scratchlm against llama.cpp on the very same weights, side by side in one run.

The model is the TinyStories shape of the CS336 assignment-1 handout (vocab 10,000, context 256, d_model 512,
4 layers, 16 heads, d_ff 1,344) with random weights (a token costs the same whatever the weights are), and
exported with `scratchlm export --format gguf`'s writer: f32 for the fp32 rows, f16 for the bf16 ones, Q8_0 for
the int8 ones (scratchlm's `--quantize int8`: int8 per output channel against llama.cpp's int8 per block of
32, both a byte a weight; scratchlm's activations quantized per block of 32 too at one or two rows, as
Q8_0's are, and float32 beyond). Each side
decodes `--tokens` tokens after a 4-token prompt, batch 1, best of `--repeats`, in turns; a warm-up run first
(scratchlm's compiles its decode step then: the compilation is paid once per process, as llama.cpp's model load
is, and is printed apart). Rows:

- greedy and sampled (temperature 0.8, top-p 0.9), at 1 and 2 threads, fp32 / f32 and bf16 / f16 (bf16 only
  where the CPU computes it natively: elsewhere PyTorch emulates it ~100x slower, and `auto` never picks it).
  Random weights give a flat next-token distribution, whose top-p nucleus is most of the vocabulary: the
  sampler's worst case on both sides (a trained model's nucleus is a few dozen tokens);
- scratchlm eager (`compile=False`) and compiled (`compile=True`, `scratchlm.generation.decode`);
- each row's bytes of weights a token reads, times tokens/s, over the memory bandwidth `scratchlm doctor`
  measures: how close to the memory-bound limit it decodes;
- prefill of a 200-token prompt, tokens/s (the last position's logits, as generating needs and llama.cpp
  computes by default);
- whether the greedy tokens of scratchlm fp32 and llama.cpp f32 are the same (and where int8 and Q8_0, two
  different roundings of the weights, part);
- int8 against scratchlm's own fp32, row by row, and the bytes of the weights each holds.

`--shape deep` takes a small downloaded chat model's shape instead (30 layers, d_model 576, 9 heads over 3
key/value heads, d_ff 1,536, vocabulary 49,152, a tied head, 8,192 positions: about 135M parameters), where the
keys and values a token reads grow with the conversation; `--prompt-tokens` sets the prompt's length (a chat's
100 to 1,000), `--decoding greedy` leaves out the sampled rows.

The serving engine's throughput at 16 concurrent sequences, eager against compiled, is
`benchmarks/bench_serve.py`'s.

llama-cpp-python is an optional dependency of this benchmark: `pip install llama-cpp-python` builds llama.cpp
from source with CMake (about 8 minutes on 2 cores).

    python benchmarks/bench_llamacpp.py
    python benchmarks/bench_llamacpp.py --tokens 120 --repeats 2 --threads 2
    python benchmarks/bench_llamacpp.py --tokens 120 --repeats 2 --precisions fp32 int8
    python benchmarks/bench_llamacpp.py --shape deep --prompt-tokens 200 --tokens 128 --threads 2 \
        --decoding greedy --precisions fp32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_generate import weight_bytes_per_token
from bench_lora import SMOLLM_135M

from scratchlm.device import plan
from scratchlm.device.profile import device_profile
from scratchlm.generation.generate import generate
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.generation.quantize import weight_bytes
from scratchlm.interop.gguf import write_gguf
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
MISSING = (
    "llama-cpp-python is not installed: `pip install llama-cpp-python` builds llama.cpp from source with "
    "CMake, in about 8 minutes on 2 cores"
)
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
SHAPES = {
    "tinystories": ModelConfig(
        vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344
    ),
    # SmolLM-135M's shape (`bench_lora`'s), at its 8,192 positions.
    "deep": dataclasses.replace(SMOLLM_135M, context_length=8_192),
}
# The rows' precisions: (scratchlm's name, the GGUF file's dtype, scratchlm's `--quantize`, the plan's precision).
PRECISIONS = {
    "fp32": ("f32", None, "fp32"),
    "bf16": ("f16", None, "bf16"),
    "int8": ("q8_0", "int8", "fp32"),
}


def small_tokenizer() -> Tokenizer:
    """A BPE of a fixture text: the GGUF file needs a vocabulary; the benchmark feeds token ids."""
    vocab, merges = train_bpe(FIXTURES / "corpus.en", 600, [END_OF_TEXT])
    return Tokenizer(vocab, merges, [END_OF_TEXT])


def scratchlm_tokens_per_s(
    model: TransformerLM, prompt: list[int], tokens: int, sampled: bool, compiled: bool, repeats: int
) -> tuple[float, list[int]]:
    settings = SAMPLED if sampled else {"temperature": 0.0}
    best, out = float("inf"), []
    for i in range(repeats):
        generator = torch.Generator().manual_seed(i)
        start = time.perf_counter()
        out = generate(model, prompt, tokens, generator=generator, compile=compiled, **settings)
        best = min(best, time.perf_counter() - start)
        assert len(out) == tokens
    return tokens / best, out


def llama_tokens_per_s(
    llm, prompt: list[int], tokens: int, sampled: bool, repeats: int
) -> tuple[float, list[int]]:
    settings = {"temp": 0.8, "top_p": 0.9, "top_k": 0} if sampled else {"temp": 0.0, "top_k": 1, "top_p": 1.0}
    best, out = float("inf"), []
    for _ in range(repeats):
        llm.reset()
        out = []
        start = time.perf_counter()
        for token in llm.generate(prompt, min_p=0.0, repeat_penalty=1.0, reset=True, **settings):
            out.append(token)
            if len(out) == tokens:
                break
        best = min(best, time.perf_counter() - start)
    return tokens / best, out


def first_difference(model: TransformerLM, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """Where two greedy sequences part, and how close the two tokens' logits were there (float32 rounding
    in a different order of operations can only swap a near-tie)."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if i is None:
        return f"identical ({len(ours)} tokens)"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours[:i]]))[0, -1].float()
    gap = (logits[ours[i]] - logits[theirs[i]]).item()
    return (
        f"identical for {i} tokens, then {ours[i]} against {theirs[i]}, logits {gap:.1e} apart (a near-tie)"
    )


def scratchlm_prefill(model: TransformerLM, prompt: list[int], repeats: int) -> float:
    ids = torch.tensor([prompt])
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model(ids, kv_cache=model.new_kv_cache(1), last_only=True)  # as `generate`'s prefill
            best = min(best, time.perf_counter() - start)
    return len(prompt) / best


def llama_prefill(llm, prompt: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        best = min(best, time.perf_counter() - start)
    return len(prompt) / best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=240, help="tokens decoded per run (default 240)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the best counts (default 3)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=tuple(PRECISIONS),
        default=list(PRECISIONS),
        help="the rows' precisions (default: all; bf16 only where the CPU computes it natively)",
    )
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tinystories", help="the model's shape")
    parser.add_argument(
        "--prompt-tokens", type=int, default=4, help="the decoded prompt's length, random ids (default 4)"
    )
    parser.add_argument("--decoding", nargs="+", choices=("greedy", "sampled"), default=["greedy", "sampled"])
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print(f"skipped: {MISSING}")
        return

    config = SHAPES[args.shape]
    torch.manual_seed(0)
    base = TransformerLM.from_config(config).eval()
    tokenizer = small_tokenizer()
    prompt = [11, 402, 77, 1203]
    if args.prompt_tokens != len(prompt):
        prompt = torch.randint(
            0, config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(2)
        ).tolist()
    long_prompt = torch.randint(
        0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    cpu = torch.device("cpu")
    fp32_plan = plan(cpu, "fp32")
    native_bf16 = fp32_plan.profile.native_bf16
    bandwidth = device_profile(cpu).memory_gbps * 1e9
    print(
        f"{fp32_plan.profile.name} ({'native' if native_bf16 else 'no native'} bf16), memory {bandwidth / 1e9:.1f} GB/s"
    )
    print(llama_cpp.llama_print_system_info().decode().strip())
    rows, agreement, held = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            ggml, quantize, computed_in = PRECISIONS[precision]
            if precision == "bf16" and not native_bf16:
                print(
                    "bf16 / f16 rows skipped: no native bf16 on this CPU (PyTorch emulates it; auto = fp32)"
                )
                continue
            # Two copies: a compiled decoder lays its model's weights out by rows (`scratchlm.generation.decode`),
            # and the eager one keeps the layout the plan measured fastest for an eager step.
            eager_model, model = (TransformerLM.from_config(config).eval() for _ in range(2))
            for copy in (eager_model, model):
                copy.load_state_dict(base.state_dict())
                prepare_for_inference(copy, plan(cpu, computed_in), quantize=quantize)
            path = Path(tmp) / f"model-{ggml}.gguf"
            write_gguf(base, tokenizer, path, ggml, "bench")
            bytes_per_token = weight_bytes_per_token(model)
            held[precision] = weight_bytes(model)
            for threads in args.threads:
                torch.set_num_threads(threads)
                llm = llama_cpp.Llama(
                    str(path),
                    n_ctx=config.context_length,
                    n_threads=threads,
                    n_threads_batch=threads,
                    seed=0,
                    verbose=False,
                )
                start = time.perf_counter()
                generate(model, prompt, args.tokens, temperature=0, compile=True)  # compiles its window here
                compile_s = time.perf_counter() - start
                for sampled in [way == "sampled" for way in args.decoding]:
                    eager, eager_ids = scratchlm_tokens_per_s(
                        model, prompt, args.tokens, sampled, False, args.repeats
                    )
                    compiled, compiled_ids = scratchlm_tokens_per_s(
                        model, prompt, args.tokens, sampled, True, args.repeats
                    )
                    theirs, their_ids = llama_tokens_per_s(llm, prompt, args.tokens, sampled, args.repeats)
                    if not sampled and precision == "fp32":
                        assert compiled_ids == eager_ids, "compiled and eager greedy tokens differ in fp32"
                    if not sampled and precision in ("fp32", "int8"):
                        agreement[precision] = first_difference(model, prompt, compiled_ids, their_ids)
                    rows.append(
                        {
                            "precision": f"{precision} / {ggml}",
                            "threads": threads,
                            "decoding": "sampled" if sampled else "greedy",
                            "scratchlm_eager": eager,
                            "scratchlm_compiled": compiled,
                            "llama_cpp": theirs,
                            "ratio": compiled / theirs,
                            "scratchlm_bandwidth_share": compiled * bytes_per_token / bandwidth,
                            "llama_cpp_bandwidth_share": theirs * bytes_per_token / bandwidth,
                            "compile_s": compile_s,
                        }
                    )
                prefill = scratchlm_prefill(model, long_prompt, args.repeats)
                theirs_prefill = llama_prefill(llm, long_prompt, args.repeats)
                for row in rows[-len(args.decoding) :]:
                    row["prefill_scratchlm"], row["prefill_llama_cpp"] = prefill, theirs_prefill
                del llm

    print(
        f"\n{args.shape} shape, batch 1, {args.tokens} tokens after a {len(prompt)}-token prompt, best of "
        f"{args.repeats}; tokens/s "
        "(the share of the memory bandwidth the weights' bytes a token reach)\n"
    )
    print(
        "| precision | threads | decoding | scratchlm eager | scratchlm compiled | llama.cpp | compiled / llama.cpp "
        "| prefill 200 tokens, scratchlm / llama.cpp |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['precision']} | {r['threads']} | {r['decoding']} | {r['scratchlm_eager']:,.0f} "
            f"| {r['scratchlm_compiled']:,.0f} ({r['scratchlm_bandwidth_share']:.0%}) "
            f"| {r['llama_cpp']:,.0f} ({r['llama_cpp_bandwidth_share']:.0%}) | **{r['ratio']:.2f}×** "
            f"| {r['prefill_scratchlm']:,.0f} / {r['prefill_llama_cpp']:,.0f} |"
        )
    per_row = len(args.decoding)
    compiles = ", ".join(f"{r['precision']} {r['threads']}t {r['compile_s']:.0f} s" for r in rows[::per_row])
    print(f"\ncompiling the decode step (once per process, thread count and precision): {compiles}")
    for precision, note in agreement.items():
        ggml = PRECISIONS[precision][0]
        print(f"greedy tokens, scratchlm {precision} compiled and llama.cpp {ggml}: {note}")
    compare_int8(rows, held)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "greedy_tokens": agreement}, indent=2))


def compare_int8(rows: list[dict], held: dict[str, int]) -> None:
    """int8 against scratchlm's own fp32, row by row (eager and compiled), and the bytes of the matrices."""
    fp32 = {(r["threads"], r["decoding"]): r for r in rows if r["precision"].startswith("fp32")}
    int8 = [r for r in rows if r["precision"].startswith("int8")]
    if int8 and fp32:
        print(
            "\n| threads | decoding | int8 / fp32 eager | int8 / fp32 compiled | int8 compiled / llama.cpp q8_0 |"
        )
        print("| ---: | --- | ---: | ---: | ---: |")
        for r in int8:
            f = fp32[r["threads"], r["decoding"]]
            print(
                f"| {r['threads']} | {r['decoding']} | {r['scratchlm_eager'] / f['scratchlm_eager']:.2f}× "
                f"| **{r['scratchlm_compiled'] / f['scratchlm_compiled']:.2f}×** | **{r['ratio']:.2f}×** |"
            )
    if "int8" in held and "fp32" in held:
        print(
            f"matrices held: int8 {held['int8'] / 2**20:.1f} MiB, fp32 {held['fp32'] / 2**20:.1f} MiB "
            f"({held['int8'] / held['fp32']:.3f}× fp32's bytes, {2 * held['int8'] / held['fp32']:.3f}× bf16's)"
        )


if __name__ == "__main__":
    main()
