"""Generation: the KV-cache path against full recomputation written here from scratch (greedy and seeded
sampling, a batch, past the context length, the ablated models), end-of-text handling and the cost per step."""

from __future__ import annotations

import pytest
import torch

from scratchlm.errors import ScratchlmError
from scratchlm.generation.generate import generate, generate_stream
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.model.transformer import TransformerLM

VOCAB, CONTEXT = 61, 16


def tiny_model(seed: int = 0, **options) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(VOCAB, CONTEXT, 32, 2, 4, None, **options).eval()


def reference_generate(
    model: TransformerLM,
    prompts: torch.Tensor,
    steps: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Full recomputation with torch's softmax: each step runs the model on the last CONTEXT tokens."""
    tokens = prompts.clone()
    with torch.no_grad():
        for _ in range(steps):
            logits = model(tokens[:, -CONTEXT:])[:, -1]
            if temperature == 0:
                next_tokens = logits.argmax(-1)
            else:  # the inverse of each row's cumulative distribution at a uniform draw, written out
                probs = torch.softmax(logits / temperature, dim=-1)
                cumulative = probs.cumsum(dim=-1)
                u = torch.rand(len(probs), 1, generator=generator)
                next_tokens = (cumulative <= u * cumulative[:, -1:]).sum(dim=-1)
            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)
    return tokens[:, prompts.shape[1] :].tolist()


# Prompts of 5 tokens and 40 new ones: 45 positions, almost three times the context.
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_batch_past_context_equals_recomputation(use_cache: bool) -> None:
    model = tiny_model()
    prompts = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    got = generate(model, prompts, 40, temperature=0, use_cache=use_cache)
    assert got == reference_generate(model, prompts, 40, temperature=0)
    assert len({tuple(row) for row in got}) == 3  # the rows really differ


def test_a_budget_of_any_size_streams_past_the_context_as_recomputation() -> None:
    """`--max-new-tokens 100000000000` is a budget like any other: the stream runs on its sliding window (in
    constant memory: only the window is kept) with the tokens of recomputation, for as long as it is read."""
    from itertools import islice

    model = tiny_model()
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    options = SamplingOptions(max_new_tokens=10**11, temperature=0)
    got = list(islice(generate_stream(model, prompt[0].tolist(), options=options), 3 * CONTEXT))
    assert got == reference_generate(model, prompt, 3 * CONTEXT, temperature=0)[0]


def test_seeded_sampling_batch_past_context_equals_recomputation() -> None:
    model = tiny_model()
    prompts = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompts, 40, temperature=1.0, generator=torch.Generator().manual_seed(5))
    expected = reference_generate(model, prompts, 40, 1.0, torch.Generator().manual_seed(5))
    assert cached == expected
    recomputed = generate(
        model, prompts, 40, temperature=1.0, generator=torch.Generator().manual_seed(5), use_cache=False
    )
    assert recomputed == expected
    other_seed = generate(model, prompts, 40, temperature=1.0, generator=torch.Generator().manual_seed(6))
    assert other_seed != cached


@pytest.mark.parametrize(
    "options", [{"norm": "post"}, {"norm": "none"}, {"positions": "none"}, {"ffn": "silu"}]
)
def test_cache_equals_recomputation_for_ablations(options: dict) -> None:
    model = tiny_model(**options)
    prompts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    got = generate(model, prompts, 30, temperature=0.9, top_p=0.9, generator=torch.Generator().manual_seed(7))
    again = generate(
        model,
        prompts,
        30,
        temperature=0.9,
        top_p=0.9,
        generator=torch.Generator().manual_seed(7),
        use_cache=False,
    )
    assert got == again
    assert generate(model, prompts, 30, temperature=0) == reference_generate(model, prompts, 30, 0)


def test_cache_costs_one_position_per_token_within_the_context() -> None:
    model = tiny_model()
    lengths: list[int] = []
    model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[-1]))
    generate(model, [1, 2, 3, 4, 5], 14, temperature=0)
    # Prefill of the prompt, then one position per step until the sequence outgrows the context (16 tokens);
    # from there each step runs on the last 16.
    assert lengths == [5] + [1] * 11 + [16] * 2
    lengths.clear()
    generate(model, [1, 2, 3, 4, 5], 14, temperature=0, use_cache=False)
    assert lengths == [*range(5, 17), 16, 16]


def test_batch_equals_each_prompt_alone() -> None:
    model = tiny_model()
    prompts = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    batch = generate(model, prompts, 25, temperature=0)
    assert batch == [generate(model, row.tolist(), 25, temperature=0) for row in prompts]


def test_eos_stops_a_row_and_the_others_continue() -> None:
    model = tiny_model()
    prompts = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(8))
    free = generate(model, prompts, 20, temperature=0)
    eos = free[0][3]  # row 0 produces this token at step 4
    stopped = generate(model, prompts, 20, temperature=0, eos_id=eos)
    for row_free, row_stopped in zip(free, stopped, strict=True):
        end = row_free.index(eos) + 1 if eos in row_free else len(row_free)
        assert row_stopped == row_free[:end]
    assert len(stopped[0]) <= 4 and stopped[0][-1] == eos


def test_generation_ends_when_every_row_has_finished() -> None:
    model = tiny_model()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    first = generate(model, [7, 8, 9], 1, temperature=0)[0]
    calls.clear()
    assert generate(model, [7, 8, 9], 50, temperature=0, eos_id=first) == [first]
    assert len(calls) == 1


def test_single_prompt_forms_stream_and_long_prompt() -> None:
    model = tiny_model()
    as_list = generate(model, [3, 1, 4, 1, 5], 20, temperature=0)
    assert isinstance(as_list, list) and all(isinstance(t, int) for t in as_list) and len(as_list) == 20
    assert generate(model, torch.tensor([3, 1, 4, 1, 5]), 20, temperature=0) == as_list
    assert list(generate_stream(model, [3, 1, 4, 1, 5], 20, temperature=0)) == as_list
    assert generate(model, [3, 1, 4], 0) == []
    # A prompt longer than the context: only its last CONTEXT tokens matter.
    long_prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(9))
    assert generate(model, long_prompt, 5, temperature=0) == generate(
        model, long_prompt[-CONTEXT:], 5, temperature=0, use_cache=False
    )


@pytest.mark.parametrize(
    ("prompt", "options", "message"),
    [
        ([], {}, "empty"),
        ([1, VOCAB], {}, "vocabulary"),
        ([-1, 2], {}, "vocabulary"),
        ([[[1]]], {}, "2-D"),
        ([1.5, 2.0], {}, "integer"),
        ([[1, 2], [3]], {}, "equal length"),
        ([1, 2], {"max_new_tokens": -1}, "max_new_tokens"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_input_is_a_user_error(prompt: list, options: dict, message: str) -> None:
    model = tiny_model()
    kwargs = {"max_new_tokens": 3, **options}
    with pytest.raises(ScratchlmError, match=message):
        generate(model, prompt, **kwargs)


def test_options_give_the_same_tokens_as_the_keywords() -> None:
    model = tiny_model()
    prompts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(10))
    options = SamplingOptions(30, temperature=0.9, top_p=0.95, top_k=7, seed=5)
    keywords = dict(temperature=0.9, top_p=0.95, top_k=7)
    expected = generate(model, prompts, 30, generator=torch.Generator().manual_seed(5), **keywords)
    assert generate(model, prompts, options=options) == expected  # its seed seeds the call's generator
    assert generate(model, prompts, options=options) == expected  # ... afresh on every call
    first = prompts[0].tolist()
    alone = generate(model, first, 30, generator=torch.Generator().manual_seed(5), **keywords)
    assert list(generate_stream(model, first, options=options)) == alone
    # A generator given draws instead of the seed (its state carries on, as across the CLI's samples).
    other = generate(model, prompts, 30, generator=torch.Generator().manual_seed(6), **keywords)
    assert generate(model, prompts, options=options, generator=torch.Generator().manual_seed(6)) == other
    assert other != expected


def test_top_k_of_one_is_greedy_at_any_temperature() -> None:
    model = tiny_model()
    prompts = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(11))
    sampled = generate(
        model, prompts, 40, temperature=2.0, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert sampled == reference_generate(model, prompts, 40, temperature=0)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"options": SamplingOptions(3), "temperature": 0.5}, "not both"),
        ({"options": SamplingOptions(3), "max_new_tokens": 3}, "not both"),
        ({"options": SamplingOptions(3, stop=["."])}, "stop strings"),
        ({}, "needs max_new_tokens"),
    ],
)
def test_options_and_keywords_do_not_mix(arguments: dict, message: str) -> None:
    model = tiny_model()
    with pytest.raises(ScratchlmError, match=message):
        generate(model, [1, 2], **arguments)
    with pytest.raises(ScratchlmError, match=message):
        list(generate_stream(model, [1, 2], **arguments))


def test_generate_stream_names_an_unknown_keyword() -> None:
    with pytest.raises(ScratchlmError, match="unknown option 'temprature'.*temperature"):
        list(generate_stream(tiny_model(), [1, 2], 3, temprature=0.5))


# -- the command line --------------------------------------------------------------------------------------


@pytest.fixture
def trained_files(tmp_path):
    """A tokenizer directory and a checkpoint of a random model that records it, as training would."""
    from scratchlm.run.checkpoint import save_checkpoint
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe
    from scratchlm.training.optim import AdamW

    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a café.<|endoftext|>Un été très chaud, naïve 日本語.\n" * 20)
    vocab, merges = train_bpe(text, 300, ["<|endoftext|>"], workers=1)
    tokenizer = Tokenizer(vocab, merges, ["<|endoftext|>"])
    tokenizer.save(tmp_path / "tokenizer")
    torch.manual_seed(0)
    model = TransformerLM(tokenizer.vocab_size, CONTEXT, 32, 2, 4, None).eval()
    checkpoint = tmp_path / "model.pt"
    train_config = {"data": {"tokenizer": str(tmp_path / "tokenizer")}}
    save_checkpoint(model, AdamW(model.parameters()), 0, checkpoint, train_config=train_config)
    return model, tokenizer, checkpoint


def test_cli_streams_the_same_text_as_generate(trained_files, capsys: pytest.CaptureFixture) -> None:
    from scratchlm.cli import main

    model, tokenizer, checkpoint = trained_files
    prompt = "Un été"
    argv = [
        "generate",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "40",
        "--precision",
        "fp32",
    ]
    assert main([*argv, "--seed", "3", "--device", "cpu", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    generator = torch.Generator().manual_seed(3)
    eos = tokenizer.token_id("<|endoftext|>")
    expected = ""
    for _ in range(2):
        ids = generate(
            model, tokenizer.encode(prompt), 40, temperature=0.8, top_p=0.9, eos_id=eos, generator=generator
        )
        expected += prompt + tokenizer.decode([t for t in ids if t != eos]) + "\n"
    assert out == expected


def test_cli_decodes_characters_split_across_tokens(
    trained_files, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scratchlm.cli import main
    from scratchlm.generation import generate as generate_module

    _, tokenizer, checkpoint = trained_files
    # "é" is the bytes C3 A9, "日" E6 97 A5: sent one byte-token at a time, then an invalid lone byte.
    pieces = [b"a", b"\xc3", b"\xa9", b"\xe6", b"\x97", b"\xa5", b"\xff", b"!"]
    ids = [next(i for i, token in tokenizer.vocab.items() if token == piece) for piece in pieces]
    monkeypatch.setattr(generate_module, "generate_stream", lambda *args, **kwargs: iter(ids))
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "xaé日\ufffd!\n"


def test_cli_says_when_the_budget_reaches_past_the_context(trained_files, capsys) -> None:
    from scratchlm.cli import main

    _, _, checkpoint = trained_files
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "Un", "--device", "cpu", "--precision"]
    for budget, past in ((CONTEXT - 4, False), (CONTEXT, True)):
        assert main([*argv, "fp32", "--temperature", "0", "--max-new-tokens", str(budget), "--no-cache"]) == 0
        said = capsys.readouterr().err
        assert (f"reaches past the model's context of {CONTEXT} tokens" in said) is past


def test_cli_bad_input_is_one_line(trained_files, tmp_path, capsys: pytest.CaptureFixture) -> None:
    from scratchlm.cli import main

    _, _, checkpoint = trained_files
    assert main(["generate", "--checkpoint", str(tmp_path / "nope.pt"), "--prompt", "a"]) == 2
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "a", "--top-p", "2"]) == 2
    assert main(["generate", "--checkpoint", str(checkpoint), "--tokenizer", str(tmp_path / "none")]) == 2
    errors = capsys.readouterr().err
    assert "Traceback" not in errors and errors.count("error:") == 3


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-k", "0"], "--top-k must be a positive integer (or None for no limit), got 0"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be an integer >= 0, got -1"),
        (["--seed", str(2**64)], "--seed must be an integer of 64 bits"),
    ],
)
def test_cli_checks_sampling_options_before_printing_anything(
    trained_files, capsys: pytest.CaptureFixture, option: list[str], message: str
) -> None:
    from scratchlm.cli import main

    _, _, checkpoint = trained_files
    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "Once upon", *option, "--device", "cpu"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the prompt is not echoed before the refusal
    assert captured.err.count("\n") == 1 and message in captured.err  # named as the flag is spelt


def test_cli_names_a_missing_run_directory_as_such(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from scratchlm.cli import main

    assert main(["generate", "--run", str(tmp_path / "nothere"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'nothere'} not found" in err and "checkpoint" not in err


def test_a_tokenizer_the_model_was_not_trained_with_is_refused(trained_files, tmp_path, capsys) -> None:
    """A checkpoint records its tokenizer's fingerprint: a different tokenizer, even a smaller one that
    would decode every id to something, is refused rather than printing replacement characters."""
    from scratchlm.cli import main
    from scratchlm.run import load_trained
    from scratchlm.run.checkpoint import save_checkpoint
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe
    from scratchlm.training.optim import AdamW

    model, tokenizer, _ = trained_files
    checkpoint = tmp_path / "recorded.pt"
    save_checkpoint(
        model,
        AdamW(model.parameters()),
        0,
        checkpoint,
        train_config={"data": {"tokenizer": str(tmp_path / "tokenizer")}},
        tokenizer_fingerprint=tokenizer.fingerprint,
    )
    other_text = tmp_path / "other.txt"
    other_text.write_text("a completely different corpus, with other merges " * 30)
    vocab, merges = train_bpe(other_text, 280, ["<|endoftext|>"], workers=1)
    other = Tokenizer(vocab, merges, ["<|endoftext|>"])
    assert other.vocab_size < model.config.vocab_size and other.fingerprint != tokenizer.fingerprint
    other.save(tmp_path / "other")

    assert (
        load_trained(checkpoint, tokenizer=tmp_path / "tokenizer").tokenizer.fingerprint
        == tokenizer.fingerprint
    )
    with pytest.raises(ScratchlmError, match="is not the one the model .* was trained with"):
        load_trained(checkpoint, tokenizer=tmp_path / "other")
    assert main(["generate", "--checkpoint", str(checkpoint), "--tokenizer", str(tmp_path / "other")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "was trained with" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("flag", [[], ["--no-compile"]])
def test_cli_says_how_it_decodes_and_no_compile_keeps_it_eager(
    trained_files, capsys: pytest.CaptureFixture, monkeypatch, flag
) -> None:
    """`generate` names the decode step's choice when it starts; `--no-compile` never compiles, and without
    it a 10-token generation does not compile either (compiling would not pay for itself)."""
    from scratchlm.cli import main
    from scratchlm.generation import decode

    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(decode, "compile_traced", refuse)  # what a CPU decode step compiles through
    _, _, checkpoint = trained_files
    argv = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "10", "--device", "cpu", *flag]
    assert main([*argv, "--precision", "fp32", "--prompt", "Un été"]) == 0
    err = capsys.readouterr().err
    assert "decode step: " in err
    assert ("--no-compile: eager decode steps" in err) == bool(flag)
