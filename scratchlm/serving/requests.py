"""The server's requests, each checked in full before anything is done: its JSON types and the server's limits
here, the sampling fields' ranges in `SamplingOptions`. Anything wrong is an `APIError`, answered with OpenAI's
error shape `{"error": {"message", "type", "param", "code"}}` and a 4xx status.

A completion's `prompt` takes OpenAI's four forms: a string, a list of strings, a list of token ids, or a list
of such lists. Token ids matter to evaluation harnesses: text decoded from a window of ids that starts inside
a multi-byte character re-encodes to other, often more, tokens, so only ids score exactly the tokens meant.

A chat body is read as the completion of its conversation (`parse_chat_request`): the model's chat template
makes the messages one prompt of token ids, and the sampling fields, `n`, the streaming fields and the limits
are checked by the same functions as a completion's, so the two APIs cannot drift apart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from scratchlm.chat.template import ChatTemplate, JinjaChatTemplate, check_messages
from scratchlm.errors import ScratchlmError
from scratchlm.generation.sampling import InvalidOption, SamplingOptions
from scratchlm.tokenizer.tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than a context of tokens
MAX_CHOICES = 64  # len(prompt) × n
MAX_TOP_LOGPROBS = 5  # as OpenAI's completions API
MAX_STOPS = 4  # as OpenAI's completions API

# The request's fields that `SamplingOptions` names otherwise.
_FIELDS = {"max_new_tokens": "max_tokens"}


class APIError(Exception):
    """An answer in OpenAI's error format: `status`, a message, its type, the parameter at fault, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


Prompt = str | list[int]  # text, or token ids


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[Prompt]
    options: SamplingOptions  # max_tokens, temperature, top_p, top_k, stop, seed
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # completions only: chat replies carry no log-probabilities here
    echo: bool = False
    tokens_as_ids: bool = False


async def read_json(request: Request) -> Any:
    """The request's body as JSON, read up to `MAX_BODY_BYTES` (413 above)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def _typed(body: dict, name: str, types: type | tuple[type, ...], default: Any, what: str) -> Any:
    """`body[name]` (`default` when absent or null) if it is of `types`; booleans are not numbers here."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)}", name)
    if not isinstance(value, types):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)}", name)
    return value


def _strings(body: dict, name: str, required: bool) -> list[str]:
    """A string or a list of strings, as `prompt` and `stop` take."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"'{name}' is required", name)
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise APIError(400, f"'{name}' must be a string or a list of strings", name)
    if required and not values:
        raise APIError(400, f"'{name}' must not be an empty list", name)
    if any(v == "" for v in values):
        raise APIError(400, f"'{name}' must not contain an empty string", name)
    return values


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """`value` as a non-empty list of token ids of a vocabulary of `vocab_size`."""
    if not _is_ids(value) or not value:
        raise APIError(400, f"'{name}' must be a non-empty list of token ids", name)
    wrong = next((v for v in value if not 0 <= v < vocab_size), None)
    if wrong is not None:
        raise APIError(
            400, f"'{name}' has the token id {wrong}; this vocabulary's ids are 0 to {vocab_size - 1}", name
        )
    return value


def _prompts(body: dict, vocab_size: int) -> list[Prompt]:
    value = body.get("prompt")
    if isinstance(value, list) and value and (_is_ids(value) or all(isinstance(v, list) for v in value)):
        return [token_ids(ids, "prompt", vocab_size) for ids in ([value] if _is_ids(value) else value)]
    if isinstance(value, list) and any(isinstance(v, int | list) for v in value):
        raise APIError(
            400,
            "'prompt' must be a string, a list of strings, or token ids (a list, or a list of lists)",
            "prompt",
        )
    return _strings(body, "prompt", required=True)


def check_model(body: dict, model_name: str) -> None:
    """A request's `model`, if it names one, is the one this server serves."""
    model = _typed(body, "model", str, model_name, "a string")
    if model != model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{model_name}'",
            "model",
            code="model_not_found",
        )


def check_context(tokens: int, context_length: int, param: str, what: str) -> None:
    """A prompt of `tokens` tokens fits the model's context (400 `context_length_exceeded` otherwise)."""
    if tokens > context_length:
        raise APIError(
            400,
            f"{what} has {tokens} tokens; this model's context is {context_length} tokens",
            param,
            code="context_length_exceeded",
        )


def _sampling_options(
    body: dict, context_length: int, max_tokens_field: str, default_max_tokens: int
) -> SamplingOptions:
    """The sampling fields of a completions or chat body as one `SamplingOptions`. The token budget is named
    `max_tokens_field` in the messages (the chat API has two names for it)."""
    stop = _strings(body, "stop", required=False)
    if len(stop) > MAX_STOPS:
        raise APIError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(stop)}", "stop")
    max_tokens = _typed(body, max_tokens_field, int, default_max_tokens, "an integer")
    if not 0 <= max_tokens <= context_length:
        raise APIError(
            400,
            f"'{max_tokens_field}' must be between 0 and the context length {context_length}, got {max_tokens}",
            max_tokens_field,
        )
    top_k = _typed(body, "top_k", int, None, "an integer")
    given = {
        "max_new_tokens": max_tokens,
        "temperature": _typed(body, "temperature", (int, float), None, "a number"),
        "top_p": _typed(body, "top_p", (int, float), None, "a number"),
        "top_k": None if top_k in (0, -1) else top_k,  # vLLM's ways of saying "no limit"
        "stop": stop,
        "seed": _typed(body, "seed", int, None, "an integer"),
    }
    try:  # the fields left out (or null) take `SamplingOptions`'s defaults, which are OpenAI's
        return SamplingOptions(**{name: value for name, value in given.items() if value is not None})
    except InvalidOption as e:
        field = max_tokens_field if e.option == "max_new_tokens" else e.option
        raise APIError(400, f"{field} {e.reason}", field) from None


def _choices(body: dict, prompts: int) -> int:
    """`n`, the completions per prompt, within `MAX_CHOICES` for the whole request."""
    n = _typed(body, "n", int, 1, "an integer")
    if n < 1 or prompts * n > MAX_CHOICES:
        raise APIError(
            400, f"'n' must be at least 1, with at most {MAX_CHOICES} completions in all (prompts × n)", "n"
        )
    return n


def _refuse(body: dict, defaults: dict[str, Any]) -> None:
    """400 for a field this server does not implement, unless absent, null or the value that means "off"."""
    for name, default in defaults.items():
        if body.get(name) not in (None, default):
            raise APIError(400, f"'{name}' is not supported by this server", name)


def _streaming(body: dict) -> tuple[bool, bool]:
    """`stream`, and `stream_options.include_usage` (a last event with the usage)."""
    stream_options = _typed(body, "stream_options", dict, {}, "an object")
    stream = _typed(body, "stream", bool, False, "a boolean")
    return stream, _typed(stream_options, "include_usage", bool, False, "a boolean")


def _object(body: Any, model_name: str) -> dict:
    """The body, which must be a JSON object naming this server's model (or none)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, model_name)
    return body


def parse_completion_request(
    body: Any, model_name: str, context_length: int, vocab_size: int
) -> CompletionRequest:
    """Check a /v1/completions body against the API and this server's limits (`APIError` on the first
    problem)."""
    body = _object(body, model_name)
    prompts = _prompts(body, vocab_size)
    options = _sampling_options(body, context_length, "max_tokens", 16)  # OpenAI's default
    n = _choices(body, len(prompts))
    logprobs = _typed(body, "logprobs", int, None, "an integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(
            400, f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}", "logprobs"
        )
    stream, include_usage = _streaming(body)
    _refuse(body, {"best_of": 1, "frequency_penalty": 0, "presence_penalty": 0})
    if body.get("logit_bias") or body.get("suffix"):
        raise APIError(400, "'logit_bias' and 'suffix' are not supported by this server")
    echo = _typed(body, "echo", bool, False, "a boolean")
    tokens_as_ids = _typed(body, "return_tokens_as_token_ids", bool, False, "a boolean")
    return CompletionRequest(prompts, options, n, stream, include_usage, logprobs, echo, tokens_as_ids)


def _max_tokens_field(body: dict) -> str:
    """Which of the chat API's two names of the token budget the body uses: `max_completion_tokens` (OpenAI's
    current one) or `max_tokens` (the older one, which most clients still send)."""
    given = [name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    if len(given) == 2 and body["max_completion_tokens"] != body["max_tokens"]:
        raise APIError(
            400,
            "'max_tokens' and 'max_completion_tokens' are the same limit and differ here; give one",
            "max_completion_tokens",
        )
    return given[0] if given else "max_completion_tokens"


def parse_chat_request(
    body: Any, model_name: str, context_length: int, template: ChatTemplate | JinjaChatTemplate
) -> CompletionRequest:
    """Check a /v1/chat/completions body, and make it the completion of its templated conversation: the
    template's token ids (ending with the assistant's generation prompt) are the one prompt, and every other
    field means what it means to a completion. Without a token budget a reply may fill the rest of the
    context (OpenAI's default for chat)."""
    body = _object(body, model_name)
    try:
        messages = check_messages(body.get("messages"))
        ids = template.encode(messages, add_generation_prompt=True)
    except ScratchlmError as e:
        raise APIError(400, str(e), "messages") from None
    check_context(len(ids), context_length, "messages", "the conversation (with the chat template)")
    options = _sampling_options(body, context_length, _max_tokens_field(body), context_length)
    n = _choices(body, 1)
    stream, include_usage = _streaming(body)
    _refuse(
        body,
        {
            "frequency_penalty": 0,
            "presence_penalty": 0,
            "logprobs": False,
            "top_logprobs": 0,
            "tools": [],
            "tool_choice": "none",
            "functions": [],
            "function_call": "none",
        },
    )
    if body.get("logit_bias"):
        raise APIError(400, "'logit_bias' is not supported by this server", "logit_bias")
    response_format = _typed(body, "response_format", dict, {"type": "text"}, "an object")
    if response_format.get("type") != "text":
        raise APIError(400, "'response_format' can only be text on this server", "response_format")
    return CompletionRequest([ids], options, n, stream, include_usage)


def tokenize_request_ids(
    body: Any, model_name: str, tokenizer: Tokenizer, template: ChatTemplate | JinjaChatTemplate | None
) -> list[int]:
    """The token ids a /tokenize body asks for, in vLLM's two shapes: `{"prompt", "add_special_tokens"}`, the
    text's ids (special tokens written in it are themselves), or `{"messages", "add_generation_prompt"}`, the
    conversation in the model's chat template (the ids the chat API prompts with, when the generation prompt is
    added, the default). `add_special_tokens` is accepted for vLLM's shape: scratchlm's tokenizers add no
    begin-of-text token."""
    body = _object(body, model_name)
    _typed(body, "add_special_tokens", bool, True, "a boolean")
    prompt = body.get("prompt")
    if "messages" in body:
        if template is None:
            raise APIError(
                400, "'messages' is a conversation, and this model has no chat template", "messages"
            )
        _refuse(body, {"continue_final_message": False})
        add_generation_prompt = _typed(body, "add_generation_prompt", bool, True, "a boolean")
        try:
            return template.encode(check_messages(body.get("messages")), add_generation_prompt)
        except ScratchlmError as e:
            raise APIError(400, str(e), "messages") from None
    if not isinstance(prompt, str):
        raise APIError(
            400, "'prompt' is required and must be a string ('messages': a conversation)", "prompt"
        )
    return tokenizer.encode(prompt)


def parse_detokenize_request(body: Any, model_name: str, vocab_size: int) -> list[int]:
    """The token ids of a /detokenize body, `{"tokens"}` as vLLM takes it."""
    body = _object(body, model_name)
    if body.get("tokens") == []:
        return []
    return token_ids(body.get("tokens"), "tokens", vocab_size)
