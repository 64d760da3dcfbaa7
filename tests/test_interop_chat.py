"""The chat template travels with the model, with transformers and the `gguf` reader as the oracles.

- `export --format hf` of a chat model writes its template into tokenizer_config.json: transformers'
  `apply_chat_template` gives exactly scratchlm's ids on conversations of every role, several turns, Unicode,
  spaces and newlines, with and without the generation prompt (and, with `sanitize_control_tokens`, on
  messages holding a special token's text); its generation_config ends a sequence at `<|end|>` too, so
  transformers' `generate` stops where scratchlm's does. The export with scratchlm's modeling code does the same.
- `export --format gguf` writes `tokenizer.chat_template` and the end-of-turn token.
- `import-hf` of a model with a ChatML template of its own keeps it: the run's tokenizer carries it, it gives
  transformers' ids, generation stops at `<|im_end|>`, and `scratchlm chat` and the server answer with it. A
  scratchlm chat export imports back with scratchlm's own template; a template scratchlm cannot use is dropped
  with a warning.
"""

from __future__ import annotations

import inspect
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from interop_helpers import (
    chat_tokenizer,
    hf_tokenizer_json,
    make_run,
    random_llama,
    run_cli,
    scratch_model,
    small_tokenizer,
)

from scratchlm import ModelConfig, Tokenizer, TransformerLM, generate, load_trained
from scratchlm.chat.template import JINJA, ChatTemplate, JinjaChatTemplate, chat_template, check_messages
from scratchlm.interop.gguf import export_gguf
from scratchlm.interop.hf import export_hf, import_hf
from scratchlm.tokenizer import END_OF_TEXT

transformers = pytest.importorskip("transformers", reason="transformers is not installed (scratchlm[hf])")

CONVERSATIONS = {
    "one message": [{"role": "user", "content": "Hello"}],
    "every role, several turns": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse: a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "Now: x y"},
    ],
    "unicode": [
        {"role": "user", "content": "naïve café, 東京, emoji 🙂"},
        {"role": "assistant", "content": "ça va? Ελληνικά"},
    ],
    "spaces": [
        {"role": "user", "content": "  leading and trailing  "},
        {"role": "assistant", "content": "\ttab\tand  double  spaces "},
    ],
    "newlines": [
        {"role": "system", "content": "line 1\nline 2\n\n"},
        {"role": "user", "content": "\n\nstarts with newlines"},
        {"role": "assistant", "content": "ends with one\n"},
        {"role": "user", "content": "\r\n windows \r\n"},
    ],
    "jinja-like text": [{"role": "user", "content": "{{ 1 + 1 }} {% if x %} '\"quotes\"' \\n"}],
}
GREEDY_BUDGET = 16

# A ChatML template of the kind Qwen's models carry, written over several lines with whitespace control.
CHATML = """{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def ids_of(hf_tokenizer, conversation: list[dict], add_generation_prompt: bool, **options) -> list[int]:
    return list(
        hf_tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **options,
        )
    )


def ending_model(config: ModelConfig, tokenizer: Tokenizer) -> TransformerLM:
    """A random model whose greedy answer to a message ends at `<|end|>` after a few tokens: the LM head's row
    of `<|end|>` is a scaled copy of the row of the token it would write fifth (the largest logit there), so
    `<|end|>` wins by then at the latest."""
    model = scratch_model(config)
    template = ChatTemplate(tokenizer)
    prompt = template.encode(check_messages(CONVERSATIONS["one message"]))
    free = generate(model, prompt, 8, temperature=0)
    with torch.no_grad():
        model.lm_head.weight[template.end] = 1.5 * model.lm_head.weight[free[4]]
    return model


def export(tmp: Path, **model) -> tuple[Tokenizer, TransformerLM, Path]:
    """A chat run of a random model (the chat tokenizer), exported for transformers."""
    tokenizer = chat_tokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        context_length=64,
        d_model=64,
        num_layers=2,
        num_heads=4,
        d_ff=96,
        **model,
    )
    model = ending_model(config, tokenizer)
    export_hf(load_trained(make_run(tmp / "run", model, tokenizer)), tmp / "hf")
    return tokenizer, model, tmp / "hf"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tokenizer, model, directory = export(tmp_path_factory.mktemp("chat-export"))
    return tokenizer, model, directory, transformers.AutoTokenizer.from_pretrained(str(directory))


# -- export ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["prompt", "no-prompt"])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_apply_chat_template_gives_scratchlm_ids(exported, name, add_generation_prompt):
    tokenizer, _, directory, hf_tokenizer = exported
    assert json.loads((directory / "tokenizer_config.json").read_text())["chat_template"] == JINJA
    conversation = CONVERSATIONS[name]
    ours = ChatTemplate(tokenizer).encode(check_messages(conversation), add_generation_prompt)
    assert ids_of(hf_tokenizer, conversation, add_generation_prompt) == ours


def test_sanitized_special_token_text_gives_scratchlm_ids(exported):
    tokenizer, _, _, hf_tokenizer = exported
    if "sanitize_control_tokens" not in inspect.signature(hf_tokenizer.apply_chat_template).parameters:
        pytest.skip("this transformers has no sanitize_control_tokens")
    conversation = [{"role": "user", "content": "I typed <|user|> and <|end|> and <|endoftext|>"}]
    ours = ChatTemplate(tokenizer).encode(check_messages(conversation))
    assert ids_of(hf_tokenizer, conversation, True, sanitize_control_tokens=True) == ours
    assert ids_of(hf_tokenizer, conversation, True) != ours  # unsanitized, transformers reads the tokens


def test_transformers_generate_stops_at_the_end_of_turn(exported):
    tokenizer, model, directory, _ = exported
    template = ChatTemplate(tokenizer)
    prompt = template.encode(check_messages(CONVERSATIONS["one message"]))
    ours = generate(
        model, prompt, GREEDY_BUDGET, temperature=0, eos_id=tokenizer.eos_id, stop_ids=template.stop_ids
    )
    assert ours[-1] == template.end and len(ours) < GREEDY_BUDGET  # the model does end its turn
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).float().eval()
    assert hf_model.generation_config.eos_token_id == [tokenizer.eos_id, template.end]
    output = hf_model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=GREEDY_BUDGET, do_sample=False, pad_token_id=tokenizer.eos_id,
    )  # fmt: skip
    assert output[0, len(prompt) :].tolist() == ours


def test_the_export_with_modeling_code_carries_the_template(tmp_path):
    tokenizer, _, directory = export(tmp_path, norm="post")
    assert (directory / "modeling_scratchlm.py").is_file()  # the custom-code path
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=True)
    conversation = CONVERSATIONS["every role, several turns"]
    assert ids_of(hf_tokenizer, conversation, True) == ChatTemplate(tokenizer).encode(
        check_messages(conversation)
    )
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_id, tokenizer.token_id("<|end|>")]


def test_gguf_holds_the_template_and_the_end_of_turn(exported, tmp_path):
    gguf = pytest.importorskip("gguf")
    tokenizer, model, _, _ = exported
    run = make_run(tmp_path / "run", model, tokenizer)
    export_gguf(load_trained(run), tmp_path / "chat.gguf")
    reader = gguf.GGUFReader(tmp_path / "chat.gguf")
    assert reader.fields["tokenizer.chat_template"].contents() == JINJA
    assert reader.fields["tokenizer.ggml.eot_token_id"].contents() == tokenizer.token_id("<|end|>")
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_id


# -- import ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """A transformers checkpoint of a chat model with a ChatML template of its own, in `chat_template.jinja`
    where recent transformers keep it, its tokenizer.json made by `tokenizers`; and its import."""
    root = tmp_path_factory.mktemp("foreign")
    base = small_tokenizer()
    tokenizer = Tokenizer(base.vocab, base.merges, [END_OF_TEXT, IM_START, IM_END])
    source = root / "hf"
    random_llama(source, vocab_size=tokenizer.vocab_size, max_position_embeddings=256)
    hf_tokenizer_json(tokenizer, source)
    (source / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END}), encoding="utf-8"
    )
    (source / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    run = import_hf(source, root / "run")
    return source, transformers.AutoTokenizer.from_pretrained(str(source)), load_trained(run)


def test_an_imported_chat_model_keeps_its_template(foreign):
    _, hf_tokenizer, trained = foreign
    assert hf_tokenizer.chat_template == CHATML  # transformers finds it there too
    assert trained.tokenizer.chat_template == CHATML
    template = chat_template(trained.tokenizer)
    assert isinstance(template, JinjaChatTemplate)
    assert trained.tokenizer.token_id(IM_END) in template.stop_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["prompt", "no-prompt"])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_the_imported_template_gives_transformers_ids(foreign, name, add_generation_prompt):
    _, hf_tokenizer, trained = foreign
    conversation = CONVERSATIONS[name]
    ours = chat_template(trained.tokenizer).encode(check_messages(conversation), add_generation_prompt)
    assert ours == ids_of(hf_tokenizer, conversation, add_generation_prompt)


def greedy_answer(trained, conversation: list[dict]) -> str:
    """`generate`'s greedy answer in the run's own template, decoded without the token that ended it."""
    template = chat_template(trained.tokenizer)
    ids = generate(
        trained.model, template.encode(check_messages(conversation)), GREEDY_BUDGET, temperature=0,
        eos_id=trained.tokenizer.eos_id, stop_ids=template.stop_ids,
    )  # fmt: skip
    return trained.tokenizer.decode(ids[:-1] if ids and ids[-1] in template.stop_ids else ids)


def test_scratchlm_chat_answers_with_the_imported_template(foreign, capsys, monkeypatch):
    _, _, trained = foreign
    run = trained.checkpoint.parent.parent
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    status, out, err = run_cli(
        ["chat", "--run", str(run), "--device", "cpu", "--precision", "fp32", "--temperature", "0",
         "--max-new-tokens", str(GREEDY_BUDGET)],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    answer = greedy_answer(trained, [{"role": "user", "content": "Hello there"}])
    assert answer and out == answer + "\n"


def test_the_server_answers_with_the_imported_template(foreign):
    pytest.importorskip("uvicorn", reason="uvicorn not installed (pip install 'scratchlm[serve]')")
    pytest.importorskip("openai", reason="openai not installed (the test oracle)")
    from serve_helpers import Running

    _, _, trained = foreign
    server = Running(trained, "imported")
    try:
        conversation = CONVERSATIONS["every role, several turns"]
        response = server.client.chat.completions.create(
            model="imported", messages=conversation, max_tokens=GREEDY_BUDGET, temperature=0
        )
        assert response.choices[0].message.content == greedy_answer(trained, conversation)
    finally:
        server.close()


def test_a_chat_export_imports_back_with_scratchlm_template(exported, tmp_path, capsys):
    tokenizer, _, directory, _ = exported
    status, out, err = run_cli(["import-hf", str(directory), "--out", str(tmp_path / "run")], capsys)
    assert status == 0, err
    imported = load_trained(tmp_path / "run").tokenizer
    assert imported.chat_template == JINJA and imported.fingerprint == tokenizer.fingerprint
    assert isinstance(chat_template(imported), ChatTemplate)
    assert "scratchlm's chat template: scratchlm chat --run" in out + err


def test_a_template_scratchlm_cannot_use_is_dropped_with_a_warning(foreign, tmp_path, capsys):
    source = shutil.copytree(foreign[0], tmp_path / "hf")
    (source / "chat_template.jinja").write_text("{% for message in messages %}", encoding="utf-8")
    status, out, err = run_cli(["import-hf", str(source), "--out", str(tmp_path / "run")], capsys)
    assert status == 0, err
    assert "chat template" in err and "imported without it" in err
    assert load_trained(tmp_path / "run").tokenizer.chat_template is None
