"""The chat template: how a conversation becomes token ids, and which of them a chat model must learn.

A conversation is a list of messages, each a role (system, user or assistant) and its content. scratchlm's
template writes each message as its role's special token, the content, and the end-of-turn token, after the
token that starts every document:

    <|endoftext|><|system|>Answer briefly.<|end|><|user|>Reverse: a b c<|end|><|assistant|>c b a<|end|>

Pretraining documents are joined by `<|endoftext|>`, so a base model reads the conversation as a new document.
To ask for a reply, the prompt ends with `<|assistant|>` (the generation prompt); the model answers and ends
its turn with `<|end|>`, where generation stops.

The content is encoded as ordinary text (`Tokenizer.encode_ordinary`): a user who types `<|user|>` gets those
characters, never the token, so no message can forge a turn. The role tokens are special tokens: never merged,
and reserved by every tokenizer scratchlm trains (`scratchlm.tokenizer.CHAT_TOKENS`).

For fine-tuning, `encode_for_training` also marks the tokens the loss counts: the content of every assistant
turn and its `<|end|>`, which is what a chat model has to produce. Everything else (the system prompt, the
user's turns, the role tokens) only conditions.

`JINJA` is the same template in the language of transformers' `apply_chat_template` and llama.cpp. It gives
the same ids for content that does not contain a special token's text (transformers, unlike this module,
reads such text as the token).

A model imported with a template of its own (ChatML, Llama 3, ...) keeps it: `JinjaChatTemplate` renders it
with jinja2, as transformers does, and encodes the result with the special tokens read as tokens. Its
end-of-turn token is the first special token the template writes after an assistant's content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import ASSISTANT, END_OF_TEXT, END_OF_TURN, SYSTEM, USER
from scratchlm.tokenizer.tokenizer import Tokenizer

ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

# The special tokens the template writes: a tokenizer that lacks some gets them added (`with_chat_tokens`).
TEMPLATE_TOKENS = (END_OF_TEXT, SYSTEM, USER, ASSISTANT, END_OF_TURN)

JINJA = (
    "{{- '<|endoftext|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Message:
    role: str  # system, user or assistant
    content: str


def check_messages(messages: object) -> list[Message]:
    """The messages of a conversation in OpenAI's form (`[{"role": ..., "content": ...}, ...]`), checked:
    a non-empty list of objects, each with a known role and non-empty text content. The error names the
    message (1-based) and what was expected; callers add where it came from."""
    if not isinstance(messages, list) or not messages:
        raise ScratchlmError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    checked = []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, Mapping):
            raise ScratchlmError(f"message {number} is not an object with a role and a content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ScratchlmError(
                f"message {number} has an unknown role {role!r} (expected system, user or assistant)"
            )
        if not isinstance(content, str):
            raise ScratchlmError(f"message {number} ({role}) has no text content (expected a string)")
        if not content:
            raise ScratchlmError(f"message {number} ({role}) has empty content")
        checked.append(Message(role, content))
    return checked


class ChatTemplate:
    """scratchlm's template (see the module docstring) over a tokenizer that has its special tokens."""

    source = JINJA

    def __init__(self, tokenizer: Tokenizer) -> None:
        missing = [token for token in TEMPLATE_TOKENS if token not in tokenizer.special_tokens]
        if missing:
            raise ScratchlmError(
                f"the tokenizer lacks the chat template's special tokens {missing}; "
                "`scratchlm sft` adds them to a base run"
            )
        self.tokenizer = tokenizer
        self.start = tokenizer.token_id(END_OF_TEXT)
        self.end = tokenizer.token_id(END_OF_TURN)
        self.role_ids = {role: tokenizer.token_id(token) for role, token in ROLES.items()}
        # Generation stops at the end of the turn, or at the end of the document a base model would write.
        self.stop_ids = frozenset({self.end, self.start})

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """The ids of `messages`, ending with `<|assistant|>` when `add_generation_prompt` (a prompt)."""
        ids, _ = self.encode_for_training(messages)
        if add_generation_prompt:
            ids.append(self.role_ids["assistant"])
        return ids

    def encode_for_training(self, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
        """The ids of `messages` and, for each, whether a fine-tuning loss counts it as a target: the
        content of the assistant's turns and the `<|end|>` that closes each of them."""
        ids, counted = [self.start], [False]
        for message in messages:
            content = self.tokenizer.encode_ordinary(message.content)
            learnt = message.role == "assistant"
            ids += [self.role_ids[message.role], *content, self.end]
            counted += [False] + [learnt] * (len(content) + 1)
        return ids, counted


class JinjaChatTemplate:
    """A chat template in Jinja (one imported with a model), rendered as transformers renders it."""

    def __init__(self, tokenizer: Tokenizer, source: str) -> None:
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ScratchlmError(
                "this model's chat template is Jinja, which needs jinja2: pip install jinja2"
            ) from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateError as e:
            raise ScratchlmError(f"the chat template does not parse: {e}") from None
        self.tokenizer, self.source = tokenizer, source
        self.stop_ids = frozenset(filter(lambda i: i is not None, (self._end_of_turn(), tokenizer.eos_id)))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The template's text for `messages`. `bos_token` is empty: scratchlm's tokenizers have no
        beginning-of-sequence token, and a template that writes one renders without it."""
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                eos_token=END_OF_TEXT if self.tokenizer.eos_id is not None else "",
                bos_token="",
            )
        except Exception as e:  # the template is data: any error of its code is the template's, not ours
            raise ScratchlmError(f"the chat template refused the conversation: {e}") from None

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(self.render(messages, add_generation_prompt))

    def _end_of_turn(self) -> int | None:
        """The first special token the template writes after an assistant's content. An imported tokenizer's
        added tokens that are not special (`AddedToken.special`: a GGUF file's user-defined tokens, such as
        `<tool_call>`) are text a model writes, never where it stops."""
        probe = "\x00probe\x00"
        text = self.render([Message("user", "x"), Message("assistant", probe)], add_generation_prompt=False)
        after = text[text.index(probe) + len(probe) :] if probe in text else ""
        options = self.tokenizer.options
        found = [
            (after.find(t), t)
            for t in self.tokenizer.special_tokens
            if t in after and options.added_token(t).special
        ]
        return self.tokenizer.token_id(min(found)[1]) if found else None


def chat_template(tokenizer: Tokenizer) -> ChatTemplate | JinjaChatTemplate | None:
    """The chat template a tokenizer carries; None for a base model's tokenizer, which has none."""
    if tokenizer.chat_template is None:
        return None
    if tokenizer.chat_template == JINJA:
        return ChatTemplate(tokenizer)
    return JinjaChatTemplate(tokenizer, tokenizer.chat_template)


def end_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids at which what a model writes ends: `<|endoftext|>` (a document's end) and, for a chat model,
    its template's end of turn. Generation, the server's engine and the exports' generation settings all
    stop here."""
    template = chat_template(tokenizer)
    turn_ends = template.stop_ids if template is not None else frozenset()
    return turn_ends | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())


def with_chat_tokens(tokenizer: Tokenizer) -> tuple[Tokenizer, list[str]]:
    """`tokenizer` carrying scratchlm's chat template, with the template's special tokens it lacked added
    (the next free ids); returns it and the tokens added."""
    added = [token for token in TEMPLATE_TOKENS if token not in tokenizer.special_tokens]
    chat = Tokenizer(
        tokenizer.vocab, tokenizer.merges, [*tokenizer.special_tokens, *added], JINJA, tokenizer.options
    )
    return chat, added
