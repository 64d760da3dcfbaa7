"""The tokenizers people download, through GGUF: Llama 3's and Qwen2's, and llama.cpp's user-defined tokens.

A tokenizer.json built here as Meta's Llama 3 and Qwen2's are (HF `tokenizers` trains the vocabulary on the
fixture texts with their split pattern; Llama 3's `ignore_merges` and its post-processor that puts
`<|begin_of_text|>` before the text; Qwen2's NFC normalizer and its added tokens, one of them not special) is
imported, exported with `scratchlm export --format gguf`, and the file is checked against two independent
readers: llama.cpp (`llama-cpp-python`, vocabulary only) must give HF `tokenizers`' ids on the original
tokenizer.json, its BOS included, over text of every kind (ASCII, code, CJK, emoji, accents composed and
decomposed, added tokens' text); and `import-gguf` must give them too, so that export and import keep the BOS.
llama.cpp applies no NFC: a Qwen2 file gives HF's ids on text in NFC form, which export says in a warning.

A GGUF file written with the `gguf` package with a user-defined token (type 4) imports as llama.cpp reads it:
the token is found in the text whether special tokens are parsed or not (`encode` and `encode_ordinary`),
decodes to its text, and is no end of turn.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from helpers import fixture_path
from interop_helpers import FIXTURE_TEXTS, fuzzed_documents, make_run, run_cli, scratch_model

from scratchlm import ModelConfig, Tokenizer
from scratchlm.interop.tokenizer_json import from_tokenizer_json

gguf = pytest.importorskip("gguf", reason="gguf is not installed (scratchlm[hf])")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (scratchlm[hf])")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

# The split patterns as Meta's and Qwen's tokenizer.json files write them.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SAMPLES = [
    "Hello, world! It's 2024; they'RE here.",
    "def f(x):\n    return x ** 2  # squares\n\n\tif a && b { c++; }",
    "東京は日本の首都です。北京欢迎你",
    "emoji 😀🎉👍🏽 ❤️\u200d🔥 🇫🇷",
    "café naïve résumé",  # composed
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301",  # decomposed: NFC composes them
    "numbers 1234567 and 3.14159, 42%",
    "  leading spaces\n\n\nand   runs\r\n",
    "<|im_start|>user\nhi<|im_end|> <tool_call>{}</tool_call><|begin_of_text|>x<|eot_id|>",
]


def texts() -> list[str]:
    return SAMPLES + fuzzed_documents(seed=7, total_chars=30_000)


def trained_tokenizer_json(kind: str, directory: Path) -> Path:
    """`directory/tokenizer.json` laid out as Llama 3's ("llama3") or Qwen2's ("qwen2") is, with a 700-token
    vocabulary trained on the fixture texts; added tokens after the vocabulary, as theirs are."""
    from tokenizers import (
        AddedToken,
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    llama3 = kind == "llama3"
    hf = tokenizers.Tokenizer(models.BPE(ignore_merges=llama3))
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN if llama3 else QWEN2_PATTERN), "isolated")
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    if not llama3:
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator([fixture_path(name).read_text() for name in FIXTURE_TEXTS], trainer)
    specials = LLAMA3_SPECIALS if llama3 else QWEN2_SPECIALS
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    if llama3:
        bos = hf.token_to_id("<|begin_of_text|>")
        hf.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
    else:
        # Qwen2.5's tool-call tags are added tokens that are not special.
        hf.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t in ("<tool_call>", "</tool_call>")]
        )
        hf.post_processor = processors.ByteLevel(trim_offsets=False)
    path = directory / "tokenizer.json"
    hf.save(str(path))
    return path


def export_tokenizer(tmp_path: Path, capsys, kind: str) -> tuple[Path, Path, str]:
    """(the tokenizer.json, the GGUF file of a small model with its imported tokenizer, export's stderr)."""
    source = trained_tokenizer_json(kind, tmp_path)
    tokenizer = from_tokenizer_json(json.loads(source.read_text()), str(source))
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, context_length=64, d_model=64, num_layers=1, num_heads=4, d_ff=96
    )
    make_run(tmp_path / "run", scratch_model(config), tokenizer)
    out = tmp_path / f"{kind}.gguf"
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(out)], capsys
    )
    assert status == 0, err
    return source, out, err


def llama_vocab(path: Path):
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def imported_tokenizer(path: Path, tmp_path: Path, capsys) -> Tokenizer:
    out = tmp_path / f"imported-{path.stem}"
    status, _, err = run_cli(["import-gguf", str(path), "--out", str(out)], capsys)
    assert status == 0, err
    return Tokenizer.from_dir(out / "tokenizer")


def test_llama3_tokenizer_exports_with_its_bos_and_llama_cpp_encodes_as_tokenizers(tmp_path, capsys):
    source, path, _ = export_tokenizer(tmp_path, capsys, "llama3")
    reader = gguf.GGUFReader(path)
    hf = tokenizers.Tokenizer.from_file(str(source))
    bos = hf.token_to_id("<|begin_of_text|>")
    assert reader.get_field("tokenizer.ggml.pre").contents() == "llama-bpe"
    assert reader.get_field("tokenizer.ggml.add_bos_token").contents() is True
    assert reader.get_field("tokenizer.ggml.bos_token_id").contents() == bos

    llm = llama_vocab(path)
    ours = imported_tokenizer(path, tmp_path, capsys)
    for text in texts():
        with_bos, without = hf.encode(text).ids, hf.encode(text, add_special_tokens=False).ids
        assert with_bos[0] == bos and with_bos[1:] == without
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == with_bos, text
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == without, text
        assert ours.encode(text, add_special_tokens=True) == with_bos, text
        assert ours.encode(text) == without, text
    # Exported again, the imported tokenizer writes the same file's tokenizer.
    again = tmp_path / "again.gguf"
    make_run(tmp_path / "run-again", scratch_model(_config(ours)), ours)
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run-again"), "--format", "gguf", "--out", str(again)], capsys
    )
    assert status == 0, err
    assert imported_tokenizer(again, tmp_path, capsys).options == ours.options


def _config(tokenizer: Tokenizer) -> ModelConfig:
    return ModelConfig(
        vocab_size=tokenizer.vocab_size, context_length=64, d_model=64, num_layers=1, num_heads=4, d_ff=96
    )


def test_qwen2_tokenizer_exports_and_llama_cpp_encodes_nfc_text_as_tokenizers(tmp_path, capsys):
    """llama.cpp normalizes nothing: on text in NFC form its ids are `tokenizers`' (whose NFC then changes
    nothing), and on any text they are `tokenizers`' ids of the text once in NFC form. Export says so."""
    source, path, err = export_tokenizer(tmp_path, capsys, "qwen2")
    assert err.startswith("warning: llama.cpp does not NFC-normalize text (tokenizer.ggml.pre = 'qwen2')")
    reader = gguf.GGUFReader(path)
    assert reader.get_field("tokenizer.ggml.pre").contents() == "qwen2"
    assert reader.get_field("tokenizer.ggml.add_bos_token").contents() is False
    hf = tokenizers.Tokenizer.from_file(str(source))
    llm = llama_vocab(path)
    ours = imported_tokenizer(path, tmp_path, capsys)
    composed = 0
    for text in texts():
        expected = hf.encode(text).ids  # Qwen2 puts nothing around the text
        nfc = unicodedata.normalize("NFC", text)
        assert llm.tokenize(nfc.encode(), add_bos=True, special=True) == expected, text
        assert ours.encode(nfc, add_special_tokens=True) == expected, text
        # The import reads the file as llama.cpp does, on any text.
        assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
        composed += nfc != text
    assert composed > 3  # the texts hold decomposed accents, where llama.cpp and the normalizer differ


def test_user_defined_tokens_export_as_type_4_and_are_text_to_llama_cpp(tmp_path, capsys):
    """Qwen2's `<tool_call>` (an added token that is not special) is written as a user-defined token: llama.cpp
    finds it whether special tokens are parsed or not, as `encode_ordinary` of the import does, and renders
    it where control tokens are left out."""
    source, path, _ = export_tokenizer(tmp_path, capsys, "qwen2")
    hf = tokenizers.Tokenizer.from_file(str(source))
    reader = gguf.GGUFReader(path)
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    kinds = {token: kind for token, kind in zip(tokens, types, strict=True) if kind in (3, 4)}
    assert kinds == {**dict.fromkeys(QWEN2_SPECIALS, 3), "<tool_call>": 4, "</tool_call>": 4}
    llm = llama_vocab(path)
    ours = imported_tokenizer(path, tmp_path, capsys)
    text = 'a<tool_call>{"x": 1}</tool_call><|im_end|>b'
    ordinary = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert hf.token_to_id("<tool_call>") in ordinary and hf.token_to_id("<|im_end|>") not in ordinary
    assert ours.encode_ordinary(text) == ordinary
    ids = hf.encode(text).ids
    assert llm.detokenize(ids, special=False) == text.replace("<|im_end|>", "").encode()
    assert llm.detokenize(ids, special=True) == ours.decode(ids).encode() == text.encode()


def user_defined_gguf(path: Path, pre: str = "gpt-2", edit=None) -> tuple[Path, dict[str, int]]:
    """A vocabulary-only GGUF file written with the `gguf` package under `tokenizer.ggml.pre` = `pre`: GPT-2's
    256 byte tokens, a few merges, the control token <|endoftext|> and the user-defined tokens <think> and
    </think>; `edit(writer, ids)` may add metadata (add_bos_token is false unless it does)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)]
    merges = ["t h", "th i", "thi n", "thin k", "Ġ t"]
    tokens += ["th", "thi", "thin", "think", "Ġt", "<|endoftext|>", "<think>", "</think>"]
    types = [1] * (len(tokens) - 3) + [3, 4, 4]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    ids = {token: i for i, token in enumerate(tokens)}
    if edit is None:
        writer.add_add_bos_token(False)
    else:
        edit(writer, ids)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path, ids


def test_a_user_defined_gguf_token_imports_as_llama_cpp_reads_it(tmp_path):
    from scratchlm.chat.template import chat_template
    from scratchlm.interop.gguf_read import GGUFFile, tokenizer_from_gguf

    path, ids = user_defined_gguf(tmp_path / "think.gguf")
    llm = llama_vocab(path)
    ours = tokenizer_from_gguf(GGUFFile(path))
    assert ours is not None
    assert ours.options.added_token("<think>").special is False
    assert ours.options.added_token("<|endoftext|>").special is True
    for text in [
        "<think>think</think> think<|endoftext|>x",
        "a<think>b <|endoftext|><think>",
        "<thin<think>k>",
        " <think>\n</think>\n\nthink",
    ]:
        assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
        assert ours.encode_ordinary(text) == llm.tokenize(text.encode(), add_bos=False, special=False), text
        encoded = ours.encode(text)
        assert ids["<think>"] in encoded
        assert ours.decode(encoded).encode() == llm.detokenize(encoded, special=True) == text.encode()
        # Left out where control tokens are: a user-defined token is text.
        assert llm.detokenize(encoded, special=False) == text.replace("<|endoftext|>", "").encode()
    # The end of a turn is a special token, never a user-defined one the template writes first.
    template = "{% for m in messages %}{{ m['content'] }}</think><|endoftext|>{% endfor %}"
    chat = Tokenizer(ours.vocab, ours.merges, ours.special_tokens, template, ours.options)
    parsed = chat_template(chat)
    assert parsed is not None and parsed.stop_ids == frozenset({ids["<|endoftext|>"]})


# (tokenizer.ggml.pre, the metadata written, the id before the text, the id after it)
AROUND = {
    "a BOS asked for": (
        "gpt-2",
        lambda w, ids: (w.add_add_bos_token(True), w.add_bos_token_id(ids["th"])),
        "th",
        None,
    ),
    "Llama 3's default BOS": (
        "llama-bpe",
        lambda w, ids: w.add_bos_token_id(ids["<think>"]),
        "<think>",
        None,
    ),
    "no BOS asked for": (
        "llama-bpe",
        lambda w, ids: (w.add_add_bos_token(False), w.add_bos_token_id(0)),
        None,
        None,
    ),
    "an EOS asked for": ("qwen2", lambda w, ids: w.add_add_eos_token(True), None, "<|endoftext|>"),
}


@pytest.mark.parametrize("case", AROUND)
def test_the_ids_around_a_text_import_as_llama_cpp_adds_them(tmp_path, case):
    """`tokenizer.ggml.add_bos_token` (true by default under Llama 3's names) and `add_eos_token` become the
    ids `encode(text, add_special_tokens=True)` puts around a text: llama.cpp's `tokenize(add_bos=True)`."""
    from scratchlm.interop.gguf_read import GGUFFile, tokenizer_from_gguf

    pre, edit, before, after = AROUND[case]
    path, ids = user_defined_gguf(tmp_path / "around.gguf", pre, edit)
    ours = tokenizer_from_gguf(GGUFFile(path))
    assert ours is not None
    assert ours.options.prefix_ids == ((ids[before],) if before else ())
    assert ours.options.suffix_ids == ((ids[after],) if after else ())
    llm = llama_vocab(path)
    for text in ["think", "", " a<think>b<|endoftext|>"]:
        assert ours.encode(text, add_special_tokens=True) == llm.tokenize(
            text.encode(), add_bos=True, special=True
        )
        assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True)
