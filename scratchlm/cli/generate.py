"""`scratchlm generate --run DIR --prompt "Once upon a time"`: sample text from a trained model, streamed.

The text is printed as it is produced, through the tokenizer's `Detokenizer`, because one token can end in the
middle of a multi-byte character that the next token completes; it holds those bytes back until the character
is whole. Each sample ends at `<|endoftext|>` or after `--max-new-tokens`, and is followed (on stderr) by its
token count and speed. With `--seed`, the samples are drawn one after the other from one generator seeded
with it.
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import (
    add_model_source_arguments,
    add_sampling_arguments,
    load_for_inference,
    sampling_options,
)

HELP = "Generate text from a trained model (a run directory or a checkpoint), streaming it as it is produced."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser, tokenizer=True)
    parser.add_argument(
        "--prompt", default="", help="text to continue (default: none, i.e. start a new document)"
    )
    add_sampling_arguments(parser)
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
    from scratchlm.tokenizer import END_OF_TEXT

    # Every option is checked before anything is loaded or printed.
    options = sampling_options(args)
    if args.num_samples < 1:
        raise ScratchlmError(f"--num-samples must be at least 1, got {args.num_samples}")
    trained, choices = load_for_inference(args, require_tokenizer=True)
    console.print(f"decode step: {choices.decode.reason}", style="dim")
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
    context = model.config.context_length
    if len(prompt_ids) + options.max_new_tokens > context:
        console.print(
            f"--max-new-tokens {options.max_new_tokens} reaches past the model's context of {context} tokens: "
            f"from there each token is predicted from the last {context} alone, recomputed at every step "
            "(slower; Ctrl-C stops)",
            style="dim",
        )
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
