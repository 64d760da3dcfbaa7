"""The HTTP side of the server: OpenAI's completions API and the web page, as a Starlette (ASGI) app.

    GET  /                     the page (`static/`: HTML, CSS and JavaScript shipped in the package)
    GET  /info                 the model's name, size and context, for the page (no key needed)
    GET  /v1/models            the one model served
    POST /v1/completions       OpenAI's (legacy) completions: prompt (text or token ids), max_tokens,
                               temperature, top_p, stop, seed, n, stream, logprobs, echo; and vLLM's top_k
    POST /v1/chat/completions  OpenAI's chat completions: messages, max_tokens or max_completion_tokens,
                               temperature, top_p, stop, seed, n, stream; and vLLM's top_k. A chat model's
                               only: a base model has no chat template, and this path answers it 404
    GET  /tokenizer_info       the tokenizer's special tokens, context and chat template, as vLLM serves them
    POST /tokenize             text, or a chat model's conversation in its template -> token ids, as vLLM
    POST /detokenize           token ids -> text, as vLLM

A request is checked in full before anything is queued; anything wrong is answered with OpenAI's error shape,
`{"error": {"message", "type", "param", "code"}}`, and a 4xx status (`APIError`), and the server carries on. The
sampling fields become one `SamplingOptions`, which checks their ranges; this module checks their JSON types
and the server's limits. Each prompt of a request, `n` times, becomes one `SequenceRequest` for the engine
(choice i is prompt i // n); with a `seed`, choice i samples with seed `seed + i`, so a request with a seed is
reproduced exactly and its choices still differ from one another.

A chat request is the completion of its conversation: the chat template makes the messages one prompt of
token ids (`parse_chat_request`), `Completions` runs it like any other, and only the answer's shape differs
(`shapes.py`). The engine of a chat model also stops at the template's end-of-turn token.

Text is produced from the tokens by the tokenizer's `Detokenizer` (a token can end inside a multi-byte
character), and while a `stop` string may be starting, up to `len(longest stop) - 1` characters are held back;
when one appears, the completion ends before it and the sequence is cancelled. End-of-text (and a chat
model's end of turn) ends a completion too (`finish_reason` "stop") and is not part of its text. `usage` counts
the prompt's tokens (a chat request's: the templated conversation's) and every token the model produced for
the completions, the one that ended it included.

Limits: a body of at most `MAX_BODY_BYTES` (413 above), `max_tokens` at most the context length (400 above;
`prompt + completion` is then capped at the context, `finish_reason` "length"), a prompt of at most the
context length (400 above), at most `MAX_CHOICES` completions per request, at most `max_queue` sequences
waiting for the batch (429 above).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from scratchlm.chat.template import ChatTemplate, JinjaChatTemplate, chat_template
from scratchlm.errors import ScratchlmError
from scratchlm.generation.engine import Failed, Finished, PromptLogprobs, SequenceRequest, Token, TokenLogprob
from scratchlm.serving.engine import Engine, QueueFull, Sequence
from scratchlm.serving.requests import (
    APIError,
    CompletionRequest,
    check_context,
    parse_chat_request,
    parse_completion_request,
    read_json,
)
from scratchlm.serving.shapes import CHAT, COMPLETION, Shape
from scratchlm.serving.text import CompletionText
from scratchlm.serving.tokenization import TOKENIZER_PATHS, tokenizer_routes
from scratchlm.tokenizer.tokenizer import Tokenizer

STATIC_DIR = Path(__file__).parent / "static"


def _logprobs_part(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprob | None], offset: int, as_ids: bool
) -> dict:
    """OpenAI's completions `logprobs` object for these tokens, whose text starts at character `offset`."""

    def name(token_id: int) -> str:
        return (
            f"token_id:{token_id}" if as_ids else tokenizer.vocab[token_id].decode("utf-8", errors="replace")
        )

    offsets = []
    for token_id in token_ids:
        offsets.append(offset)
        offset += len(tokenizer.vocab[token_id].decode("utf-8", errors="replace"))
    return {
        "tokens": [name(t) for t in token_ids],
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": [None if lp is None else {name(t): v for t, v in lp.top.items()} for lp in logprobs],
        "text_offset": offsets,
    }


class GenerationFailed(Exception):
    """The engine could not finish a sequence (the server is stopping, or a bug)."""


class Completions:
    """Runs the choices of one completions (or chat) request on the engine and makes their pieces."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, request: CompletionRequest) -> None:
        self.engine, self.tokenizer, self.request = engine, tokenizer, request
        self.prompt_ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in request.prompts]
        self.prompt_texts = [tokenizer.decode(p) if isinstance(p, list) else p for p in request.prompts]
        for ids in self.prompt_ids:
            check_context(len(ids), engine.model.config.context_length, "prompt", "the prompt")
        self.usage = {
            "prompt_tokens": request.n * sum(map(len, self.prompt_ids)),
            "completion_tokens": 0,
        }
        self.sequences: list[Sequence] = []

    def submit(self) -> None:
        request, options = self.request, self.request.options
        sequence_requests = []
        for index in range(len(request.prompts) * request.n):
            ids = self.prompt_ids[index // request.n]
            choice_options = replace(
                options,
                max_new_tokens=min(options.max_new_tokens, self.engine.budget(len(ids))),
                # torch reads a seed modulo 2**64: the same generator as seed + index, which cannot overflow
                seed=None if options.seed is None else (options.seed + index) % 2**64,
            )
            sequence_requests.append(
                SequenceRequest(
                    ids,
                    choice_options,
                    top_logprobs=request.logprobs,
                    prompt_logprobs=request.echo and request.logprobs is not None,
                )
            )
        try:
            self.sequences = self.engine.submit(sequence_requests)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None

    def cancel(self) -> None:
        for sequence in self.sequences:
            self.engine.cancel(sequence)

    async def _choice(self, index: int) -> AsyncIterator[dict]:
        """Pieces of choice `index`: `{"index", "text", "logprobs", "finish_reason"}`, the last with a reason."""
        request, sequence = self.request, self.sequences[index]
        prompt_ids, prompt = self.prompt_ids[index // request.n], self.prompt_texts[index // request.n]
        text = CompletionText(self.tokenizer, request.options.stop, len(prompt) if request.echo else 0)

        def piece(content: str, ids: list[int], lps: list, offset: int, reason: str | None = None) -> dict:
            logprobs = (
                None
                if request.logprobs is None
                else _logprobs_part(self.tokenizer, ids, lps, offset, request.tokens_as_ids)
            )
            return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}

        if request.echo and request.logprobs is None:
            yield piece(prompt, [], [], 0)
        while True:
            event = await sequence.events.get()
            if isinstance(event, PromptLogprobs):
                yield piece(prompt, prompt_ids, [None, *event.tokens], 0)
            elif isinstance(event, Token):
                self.usage["completion_tokens"] += 1
                if event.token_id in self.engine.stop_ids:
                    # The end of the text (or of a chat turn), not part of it (`Finished` follows); but a token
                    # the model chose, so its log-probability is reported: a harness that asks for one token
                    # reads the last.
                    if request.logprobs is not None:
                        offset = text.offset + len(text.text)
                        yield piece("", [event.token_id], [event.logprob], offset)
                    continue
                offset = text.offset + len(text.text)
                content, stopped = text.add(event.token_id)
                if stopped:
                    self.engine.cancel(sequence)
                    yield piece(content, [event.token_id], [event.logprob], offset, "stop")
                    return
                yield piece(content, [event.token_id], [event.logprob], offset)
            elif isinstance(event, Finished):
                content, stopped = text.add(None)
                reason = "stop" if stopped else event.reason
                yield piece(content, [], [], text.offset + len(text.text) - len(content), reason)
                return
            elif isinstance(event, Failed):
                raise GenerationFailed(event.message)

    async def pieces(self) -> AsyncIterator[dict]:
        """The pieces of every choice, as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for item in self._choice(index):
                    await queue.put(item)
                await queue.put(None)
            except GenerationFailed as e:
                await queue.put(e)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.sequences))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()


def _usage(completions: Completions) -> dict:
    total = completions.usage["prompt_tokens"] + completions.usage["completion_tokens"]
    return {**completions.usage, "total_tokens": total}


async def _stream(completions: Completions, head: dict, shape: Shape) -> AsyncIterator[str]:
    # A client that goes away cancels this generator where it waits; `pieces` then cancels the sequences.
    try:
        for choice in shape.opening(len(completions.sequences)):
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        async for item in completions.pieces():
            yield f"data: {json.dumps({**head, 'choices': [shape.chunk(item)]})}\n\n"
        if completions.request.include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(completions)})}\n\n"
    except GenerationFailed as e:
        error = APIError(503, str(e), type="server_error", code="generation_failed")
        yield f"data: {json.dumps({'error': json.loads(error.response().body)['error']})}\n\n"
    yield "data: [DONE]\n\n"


async def _complete(request: Request, completions: Completions, head: dict, shape: Shape) -> Response:
    async def collect() -> list[dict]:
        return [item async for item in completions.pieces()]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(collect()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client went away: nobody will read the answer
            work.cancel()
            completions.cancel()
    try:
        pieces = work.result()
    except GenerationFailed as e:
        raise APIError(503, str(e), type="server_error", code="generation_failed") from None
    by_choice: dict[int, list[dict]] = {}
    for item in pieces:
        by_choice.setdefault(item["index"], []).append(item)
    choices = [shape.choice(by_choice[index]) for index in sorted(by_choice)]
    return JSONResponse({**head, "choices": choices, "usage": _usage(completions)})


async def _answer(request: Request, completions: Completions, shape: Shape, model_name: str) -> Response:
    """Queue a checked request's sequences and answer it, streamed or whole, in `shape`."""
    completions.submit()
    head = shape.head(model_name, completions.request.stream)
    if completions.request.stream:
        return StreamingResponse(_stream(completions, head, shape), media_type="text/event-stream")
    return await _complete(request, completions, head, shape)


async def _no_chat(request: Request) -> Response:
    raise APIError(
        404,
        "this server has no /v1/chat/completions: it serves a base model, which has no chat template; "
        "use /v1/completions",
        code="not_found",
    )


async def _page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html")


async def _api_error(request: Request, exc: Exception) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    messages = {404: f"no such path: {request.url.path}", 405: f"{request.method} is not allowed here"}
    message = messages.get(exc.status_code, str(exc.detail))
    return APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    # A bug: still an answer in the API's shape, without the traceback.
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def _chat_template(engine: Engine, tokenizer: Tokenizer) -> ChatTemplate | JinjaChatTemplate | None:
    """The template the chat API applies (None: a base model), checked against the engine: an engine that
    would not stop at the end of a turn would let the model go on to write the user's next message."""
    template = chat_template(tokenizer)
    if template is not None and not template.stop_ids <= engine.stop_ids:
        raise ScratchlmError(
            "the engine of a chat model must stop at its end-of-turn token: "
            "Engine(..., stop_ids=end_ids(tokenizer))"
        )
    return template


def create_app(
    engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: str | None = None
) -> Starlette:
    """The server's ASGI app around a started `engine`; the chat API is there when the tokenizer carries a
    chat template."""
    config = engine.model.config
    created = int(time.time())
    template = _chat_template(engine, tokenizer)
    # A maximum over the vocabulary (GPT-2's: 1.5 ms on the event loop): taken once, not per request.
    vocab_size = tokenizer.vocab_size

    async def completions_endpoint(request: Request) -> Response:
        completion_request = parse_completion_request(
            await read_json(request), model_name, config.context_length, vocab_size
        )
        return await _answer(
            request, Completions(engine, tokenizer, completion_request), COMPLETION, model_name
        )

    async def chat_endpoint(request: Request) -> Response:
        assert template is not None  # the route is there only with a template
        chat_request = parse_chat_request(
            await read_json(request), model_name, config.context_length, template
        )
        return await _answer(request, Completions(engine, tokenizer, chat_request), CHAT, model_name)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "scratchlm"}],
            }
        )

    async def info(request: Request) -> Response:
        return JSONResponse(
            {
                "model": model_name,
                "parameters": engine.model.num_parameters(),
                "context_length": config.context_length,
                "api_key_required": api_key is not None,
                "chat": template is not None,
                "compiling": engine.batch.compiling(),
            }
        )

    return Starlette(
        routes=[
            Route("/", _page),
            Route("/info", info),
            Route("/v1/models", models),
            Route("/v1/completions", completions_endpoint, methods=["POST"]),
            (
                Route("/v1/chat/completions", _no_chat, methods=["GET", "POST"])
                if template is None
                else Route("/v1/chat/completions", chat_endpoint, methods=["POST"])
            ),
            *tokenizer_routes(tokenizer, model_name, config.context_length, template),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ],
        middleware=[] if api_key is None else [Middleware(_RequireKey, api_key=api_key)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
    )


class _RequireKey:
    """ASGI middleware: every request to the API (/v1/ and the tokenizer's paths) needs `Authorization: Bearer
    KEY`; the page and /info do not."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and (path.startswith("/v1/") or path in TOKENIZER_PATHS)
        if guarded and dict(scope["headers"]).get(b"authorization") != self.expected:
            error = APIError(
                401,
                "a valid API key is needed: send 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
