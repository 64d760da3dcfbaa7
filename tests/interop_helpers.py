"""Builders shared by the interoperability tests: tokenizers, scratchlm run directories, transformers
checkpoints made by transformers itself, and the command line run in this process."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from helpers import fixture_path

from scratchlm import ModelConfig, Tokenizer, TransformerLM, train_bpe
from scratchlm.cli import main
from scratchlm.run import RunDirectory
from scratchlm.run.checkpoint import save_checkpoint
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.training.optimizers import OptimizerConfig, build_optimizer

FIXTURE_TEXTS = (
    "address.txt",
    "corpus.en",
    "german.txt",
    "tinystories_sample.txt",
    "special_token_double_newlines_non_whitespace.txt",
    "special_token_trailing_newlines.txt",
)


@functools.cache
def gpt2_tokenizer() -> Tokenizer:
    return Tokenizer.from_files(
        fixture_path("gpt2_vocab.json"), fixture_path("gpt2_merges.txt"), [END_OF_TEXT]
    )


@functools.cache
def small_tokenizer() -> Tokenizer:
    """A 600-token BPE trained on a fixture: ids unlike GPT-2's, so nothing can pass by knowing GPT-2."""
    vocab, merges = train_bpe(fixture_path("corpus.en"), 600, [END_OF_TEXT])
    return Tokenizer(vocab, merges, [END_OF_TEXT])


@functools.cache
def chat_tokenizer() -> Tokenizer:
    """The small tokenizer with the chat template's special tokens added: a chat model's, as `scratchlm sft`
    makes one of a base run's."""
    from scratchlm.chat.template import with_chat_tokens

    return with_chat_tokens(small_tokenizer())[0]


def scratch_model(config: ModelConfig, seed: int = 0) -> TransformerLM:
    """A randomly initialised model, its RMSNorm gains randomised too (they start at 1, which would hide a
    gain applied to the wrong dimension)."""
    torch.manual_seed(seed)
    model = TransformerLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)
    return model


def make_run(directory: Path, model: TransformerLM, tokenizer: Tokenizer) -> Path:
    """A run directory as training leaves one: a checkpoint (with the tokenizer's fingerprint) and the
    tokenizer."""
    optimizer = build_optimizer(OptimizerConfig(), model)
    run = RunDirectory(directory)
    save_checkpoint(model, optimizer, 0, run.checkpoint(0), tokenizer_fingerprint=tokenizer.fingerprint)
    tokenizer.save(directory / "tokenizer")
    return directory


def hf_tokenizer_json(tokenizer: Tokenizer, directory: Path) -> Path:
    """`directory/tokenizer.json` built by HF `tokenizers` itself from the tokenizer's vocab.json and
    merges.txt (GPT-2's files), with its byte-level pre-tokenizer and decoder: what a Hugging Face checkpoint
    of a GPT-2-style model carries."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    files = tokenizer.save(directory / "scratchlm-tokenizer")
    hf = HFTokenizer(models.BPE.from_file(str(files / "vocab.json"), str(files / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(tokenizer.special_tokens)
    hf.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def random_llama(directory: Path, seed: int = 0, **settings) -> torch.nn.Module:
    """A transformers LlamaForCausalLM (or Qwen3 with `model_type="qwen3"`) with random weights of a scale
    that makes every layout mistake visible, saved to `directory` as safetensors."""
    import transformers

    values = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5_000.0,
        tie_word_embeddings=False,
    )
    values |= settings
    model_type = values.pop("model_type", "llama")
    shard_size = values.pop("max_shard_size", None)
    if model_type == "qwen3":
        config = transformers.Qwen3Config(
            head_dim=values["hidden_size"] // values["num_attention_heads"], **values
        )
        model = transformers.Qwen3ForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**values))
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.15)
    model.eval()
    model.save_pretrained(str(directory), **({"max_shard_size": shard_size} if shard_size else {}))
    return model


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `scratchlm ARGV` run in this process."""
    capsys.readouterr()  # leave out what came before (transformers' progress bars, for one)
    try:
        status = main(argv)
    except SystemExit as e:  # argparse exits 2 on a malformed command line
        status = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# Pieces of fuzzed text: prose with contractions, code, control bytes, emoji, CJK, combining marks, whitespace
# runs, digits, added tokens' text with whitespace around it, and Latin-1 bytes.
SEGMENTS = [
    lambda r: " ".join(
        r.choice(
            [
                "the",
                "The",
                "Hello",
                "world",
                "tokenizer",
                "café",
                "naïve",
                "it's",
                "DON'T",
                "we'll",
                "they'RE",
                "hello",
            ]
        )
        for _ in range(r.randint(1, 8))
    ),
    lambda r: r.choice(
        [
            "def f(x):\n    return x + 1\n",
            "if (a && b) { c++; }",
            "for i in range(10):\n\tpass",
            "x = [1, 2, 3]  # list",
            "a, b, c",
            "!!! ??? ...",
            "<x>",
            "<e\u0301>",
            "<é>",
        ]
    ),
    lambda r: "".join(chr(r.randint(0, 0x1F)) for _ in range(r.randint(1, 4))),
    lambda r: "".join(r.choice("😀🎉👍🏽❤️\u200d🔥🇫🇷") for _ in range(r.randint(1, 4))),
    lambda r: "".join(chr(r.randint(0x4E00, 0x4FFF)) for _ in range(r.randint(1, 6))),
    lambda r: "".join(
        r.choice("aeouAE") + r.choice("\u0301\u0300\u0308\u0327") for _ in range(r.randint(1, 4))
    ),
    lambda r: "".join(
        r.choice([" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\x85", " \n "])
        for _ in range(r.randint(1, 5))
    ),
    lambda r: (
        "".join(r.choice("0123456789") for _ in range(r.randint(1, 12))) + r.choice(["", ".5", "%", "٣٤"])
    ),
    lambda r: (
        r.choice([" ", "", "\n", "  "])
        + r.choice(
            [
                "<|im_start|>",
                "<|im_end|>",
                "<|endoftext|>",
                "<mask>",
                "<sep>",
                "<s>",
                "</s>",
                "<|begin_of_text|>",
                "hello",
                "ab",
            ]
        )
        + r.choice([" ", "", "\n", "  "])
    ),
    lambda r: bytes(r.randint(0x80, 0xFF) for _ in range(3)).decode("latin-1"),
]


def fuzzed_documents(seed: int, total_chars: int) -> list[str]:
    """Documents of 0 to 2,000 characters, `total_chars` in all, each a random mix of the segments."""
    r = random.Random(seed)
    documents, size = [], 0
    while size < total_chars:
        length = r.randint(0, 2_000)
        parts: list[str] = []
        while sum(map(len, parts)) < length:
            parts.append(r.choice(SEGMENTS)(r))
        documents.append("".join(parts))
        size += len(documents[-1])
    return documents
