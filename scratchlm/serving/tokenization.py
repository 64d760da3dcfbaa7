"""The tokenizer over HTTP, in the shapes vLLM serves it, which evaluation harnesses look for: with them
lm-evaluation-harness's `local-completions` model needs no tokenizer of its own, counts context lengths in the
model's tokens and sends its prompts as token ids.

    GET  /tokenizer_info   {"tokenizer_class", "eos_token", "bos_token", "pad_token", "model_max_length",
                            "vocab_size", "special_tokens", "chat_template"}
    POST /tokenize         {"prompt", "add_special_tokens"} or {"messages", "add_generation_prompt"}
                           -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize       {"tokens"} -> {"prompt"}

Special tokens written in the text (`<|endoftext|>`) are encoded as themselves, as in every tokenizer these
clients know: a harness finds the end-of-text id by tokenizing `eos_token`. A base model's tokenizer has no
begin-of-text token, so `add_special_tokens` changes nothing. `chat_template` is a chat model's template, its
Jinja source as transformers reads it (a harness can render the conversations itself and send text); null for
a base model. A conversation (`messages`) is tokenized in that template, as the chat API prompts with it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from scratchlm.chat.template import ChatTemplate, JinjaChatTemplate
from scratchlm.serving.requests import parse_detokenize_request, read_json, tokenize_request_ids
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.tokenizer import Tokenizer

TOKENIZER_PATHS = frozenset({"/tokenizer_info", "/tokenize", "/detokenize"})


def tokenizer_routes(
    tokenizer: Tokenizer,
    model_name: str,
    context_length: int,
    template: ChatTemplate | JinjaChatTemplate | None,
) -> list[Route]:
    vocab_size = tokenizer.vocab_size  # a maximum over the vocabulary: once, not per request

    async def info(request: Request) -> Response:
        return JSONResponse(
            {
                "tokenizer_class": "scratchlm.Tokenizer",
                "eos_token": END_OF_TEXT if tokenizer.eos_id is not None else None,
                "bos_token": None,
                "pad_token": None,
                "model_max_length": context_length,
                "vocab_size": vocab_size,
                "special_tokens": tokenizer.special_tokens,
                "chat_template": tokenizer.chat_template,
            }
        )

    async def tokenize(request: Request) -> Response:
        ids = tokenize_request_ids(await read_json(request), model_name, tokenizer, template)
        return JSONResponse(
            {"count": len(ids), "max_model_len": context_length, "tokens": ids, "token_strs": None}
        )

    async def detokenize(request: Request) -> Response:
        ids = parse_detokenize_request(await read_json(request), model_name, vocab_size)
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    return [
        Route("/tokenizer_info", info),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
