"""`scratchlm generate --run DIR --prompt "Once upon a time"`: sample text from a trained model, streamed.

The text is printed as it is produced, through the tokenizer's `Detokenizer`, because one token can end in the
middle of a multi-byte character that the next token completes; it holds those bytes back until the character
is whole. Each sample ends at `<|endoftext|>` or after `--max-new-tokens`, and is followed (on stderr) by its
token count and speed. With `--seed`, the samples are drawn one after the other from one generator seeded
with it.
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_model_source_arguments, load_for_inference

HELP = "Generate text from a trained model (a run directory or a checkpoint), streaming it as it is produced."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser, tokenizer=True)
    parser.add_argument(
        "--prompt", default="", help="text to continue (default: none, i.e. start a new document)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="token budget per sample (default 256)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)"
    )
    parser.add_argument(
        "--top-p", type=float, default=0.9, help="nucleus sampling mass in (0, 1] (default 0.9)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens only")
    parser.add_argument("--seed", type=int, default=None, help="random seed, for reproducible samples")
    parser.add_argument("--num-samples", type=int, default=1, help="how many samples to draw (default 1)")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the whole context for every token (slow; for comparison)",
    )


def run(args: argparse.Namespace) -> None:
    import sys
    import time

    from scratchlm.console import console
    from scratchlm.errors import ScratchlmError
    from scratchlm.generation.generate import generate_stream
    from scratchlm.generation.sampling import InvalidOption, SamplingOptions
    from scratchlm.tokenizer import END_OF_TEXT

    # Every option is checked before anything is loaded or printed.
    try:
        options = SamplingOptions(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except InvalidOption as e:  # named as the flag: --top-p, not top_p
        raise ScratchlmError(f"--{e.option.replace('_', '-')} {e.reason}") from None
    if args.num_samples < 1:
        raise ScratchlmError(f"--num-samples must be at least 1, got {args.num_samples}")
    trained, _ = load_for_inference(args, require_tokenizer=True)
    model, tokenizer = trained.model, trained.tokenizer
    device = next(model.parameters()).device
    eos_id = tokenizer.eos_id
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        if eos_id is None:
            raise ScratchlmError(
                f"give a --prompt: the tokenizer has no {END_OF_TEXT} to start a document with"
            )
        prompt_ids = [eos_id]  # an empty prompt starts a fresh document, as after a document boundary
    generator = options.generator(device)
    for sample in range(args.num_samples):
        if args.num_samples > 1:
            console.rule(f"sample {sample + 1}/{args.num_samples}")
        text = tokenizer.detokenizer()
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        count, start = 0, time.perf_counter()
        stream = generate_stream(
            model,
            prompt_ids,
            options=options,
            eos_id=eos_id,
            generator=generator,
            use_cache=not args.no_cache,
        )
        for token in stream:
            count += 1
            if token == eos_id:
                break
            sys.stdout.write(text.add(token))
            sys.stdout.flush()
        sys.stdout.write(text.flush() + "\n")
        sys.stdout.flush()
        seconds = time.perf_counter() - start
        ending = END_OF_TEXT if count and token == eos_id else "token budget"
        console.print(
            f"{count} tokens in {seconds:.2f} s: {count / max(seconds, 1e-9):.1f} tokens/s (stopped at {ending})",
            style="dim",
        )
