"""The server's side of the protocol evaluation harnesses speak: completions from token-id prompts and the
tokenizer's endpoints (`/tokenizer_info`, `/tokenize`, `/detokenize`, in vLLM's shapes). The oracles: the
`Tokenizer` itself, `torch.log_softmax` of the model's logits, and `generate_stream` from the same ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="starlette not installed (pip install 'scratchlm[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (pip install 'scratchlm[serve]')")
pytest.importorskip("openai", reason="openai not installed (the test oracle)")
from interop_helpers import small_tokenizer  # noqa: E402
from serve_helpers import Running, log_softmax_oracle, request, tiny_run  # noqa: E402

from scratchlm.run.load import load_trained  # noqa: E402
from scratchlm.tokenizer import END_OF_TEXT  # noqa: E402

CONTEXT = 48
TEXTS = ["Once upon a time", "naïve café — 東京 🙂", "two\n\nlines", f"a{END_OF_TEXT}b", " "]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("tokens") / "tiny-run", CONTEXT, seed=5)


@pytest.fixture(scope="module")
def server(run_dir):
    running = Running(load_trained(run_dir), "tiny-run")
    yield running
    running.close()


@pytest.fixture(scope="module")
def keyed_server(run_dir):
    running = Running(load_trained(run_dir), "tiny-run", api_key="sesame")
    yield running
    running.close()


def post(server, path: str, body, headers: dict | None = None):
    return request(server.url, "POST", path, json.dumps(body).encode(), headers)


def completion(server, prompt, **options) -> dict:
    reply = post(server, "/v1/completions", {"model": "tiny-run", "prompt": prompt, **options})
    assert reply.status_code == 200, reply.text
    return reply.json()


def mid_character_window(server) -> list[int]:
    """Ids of a text with multi-byte characters, cut so that the window starts inside one of them: decoded
    and re-encoded, such a window is not the same ids."""
    ids = server.tokenizer.encode("東京の天気は晴れ、明日も晴れるでしょう。")
    for start in range(1, len(ids)):
        window = ids[start : start + 32]
        if server.tokenizer.encode(server.tokenizer.decode(window)) != window:
            return window
    pytest.fail("no window of this text starts inside a character")


def test_a_token_id_prompt_is_scored_exactly_as_given(server) -> None:
    ids = mid_character_window(server)
    choice = completion(server, ids, max_tokens=0, echo=True, logprobs=1, return_tokens_as_token_ids=True)[
        "choices"
    ][0]
    expected, best = log_softmax_oracle(server, ids)
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == ids
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    # What lm-evaluation-harness reads as "greedy": the token's log-probability is the top one's.
    tops = choice["logprobs"]["top_logprobs"][1:]
    assert [next(iter(top)) for top in tops] == [f"token_id:{b}" for b in best[:-1]]
    assert choice["text"] == server.tokenizer.decode(ids)


def test_a_batch_of_token_id_prompts_scores_each(server) -> None:
    prompts = [server.tokenizer.encode(text) for text in TEXTS[:3]]
    response = completion(server, prompts, max_tokens=1, temperature=0, echo=True, logprobs=1)
    choices = sorted(response["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for ids, choice in zip(prompts, choices, strict=True):
        expected, best = log_softmax_oracle(server, ids)
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(ids) + 1  # the one new token, end-of-text or not
        assert logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert response["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_greedy_from_token_ids_equals_generate_from_them(server) -> None:
    ids = mid_character_window(server)[:8]
    choice = completion(
        server, ids, max_tokens=12, temperature=0, logprobs=0, return_tokens_as_token_ids=True
    )
    got = [int(t.removeprefix("token_id:")) for t in choice["choices"][0]["logprobs"]["tokens"]]
    expected = server.expected(ids, 12, temperature=0)
    assert got == expected


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_and_detokenize_are_the_tokenizer(server, text: str) -> None:
    reply = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    ids = server.tokenizer.encode(text)
    assert reply == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids, "token_strs": None}
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": server.tokenizer.decode(ids)}
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == text


def test_tokenizer_info_names_the_end_of_text_token(server) -> None:
    info = request(server.url, "GET", "/tokenizer_info").json()
    assert info["eos_token"] == END_OF_TEXT and info["bos_token"] is None
    assert info["model_max_length"] == CONTEXT
    # How a harness finds the id: it tokenizes the token's text.
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [server.tokenizer.token_id(END_OF_TEXT)]


VOCAB = small_tokenizer().vocab_size
BAD = [
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True, 2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1.5, 2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [VOCAB]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], [VOCAB + 7]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * (CONTEXT + 1)}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", [1, 2], 400, None),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": [[1]]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=range(len(BAD)))
def test_bad_input_is_an_openai_error(server, path, body, status, param) -> None:
    reply = post(server, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "Traceback" not in reply.text


def test_the_body_limit_holds_for_the_tokenizer_too(server) -> None:
    reply = post(server, "/tokenize", {"prompt": "a" * (1 << 20)})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"


def test_the_key_guards_the_tokenizer_endpoints(keyed_server) -> None:
    for method, path, body in (
        ("GET", "/tokenizer_info", None),
        ("POST", "/tokenize", b'{"prompt": "a"}'),
        ("POST", "/detokenize", b'{"tokens": [1]}'),
    ):
        assert request(keyed_server.url, method, path, body).status_code == 401
        with_key = request(keyed_server.url, method, path, body, {"Authorization": "Bearer sesame"})
        assert with_key.status_code == 200, with_key.text
