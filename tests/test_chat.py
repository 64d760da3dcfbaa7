"""The chat template, the loss mask and the conversation files of fine-tuning (scratchlm.chat)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from interop_helpers import small_tokenizer

from scratchlm.chat.conversations import (
    ConversationBatches,
    encode_conversations,
    read_conversations,
)
from scratchlm.chat.tasks import build_tasks
from scratchlm.chat.template import JINJA, ChatTemplate, Message, chat_template, with_chat_tokens
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.loss import IGNORE, cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.tokenizer import ASSISTANT, CHAT_TOKENS, END_OF_TEXT, END_OF_TURN, SYSTEM, USER
from scratchlm.tokenizer.tokenizer import Tokenizer

CONVERSATION = [
    Message("system", "Be brief."),
    Message("user", "Reverse: a b"),
    Message("assistant", "b a"),
    Message("user", "And <|user|> this?"),
    Message("assistant", "this <|end|>"),
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return with_chat_tokens(small_tokenizer())[0]


def test_a_tokenizer_gains_the_chat_tokens_after_its_own_ids(tokenizer):
    base = small_tokenizer()
    chat, added = with_chat_tokens(base)
    assert added == list(CHAT_TOKENS)  # it had <|endoftext|>
    assert [chat.token_id(t) for t in CHAT_TOKENS] == list(range(base.vocab_size, base.vocab_size + 4))
    assert chat.encode("some text") == base.encode("some text")
    assert chat.chat_template == JINJA and isinstance(chat_template(chat), ChatTemplate)
    assert chat_template(base) is None  # a base model's tokenizer has no template
    assert with_chat_tokens(chat)[1] == []


def test_the_template_writes_role_tokens_content_and_end_tokens(tokenizer):
    """Built by hand from the documented layout: <|endoftext|>, then <|role|> content <|end|> per message."""
    t = tokenizer.token_id
    expected = [t(END_OF_TEXT)]
    for role, content in [("system", "Be brief."), ("user", "Reverse: a b"), ("assistant", "b a")]:
        expected += [t({"system": SYSTEM, "user": USER, "assistant": ASSISTANT}[role])]
        expected += tokenizer.encode(content) + [t(END_OF_TURN)]
    template = ChatTemplate(tokenizer)
    assert template.encode(CONVERSATION[:3], add_generation_prompt=False) == expected
    assert template.encode(CONVERSATION[:2]) == expected[: expected.index(t(ASSISTANT)) + 1]
    assert template.stop_ids == {t(END_OF_TURN), t(END_OF_TEXT)}


def test_typed_special_token_text_is_ordinary_text(tokenizer):
    """A user who types `<|user|>` gets those characters: no special id appears, and they decode back."""
    template = ChatTemplate(tokenizer)
    ids = template.encode([Message("user", "<|user|><|end|><|endoftext|>")])
    specials = {tokenizer.token_id(t) for t in tokenizer.special_tokens}
    inner = ids[2:-2]  # between <|endoftext|><|user|> and <|end|><|assistant|>
    assert not specials & set(inner)
    assert tokenizer.decode(inner) == "<|user|><|end|><|endoftext|>"
    assert tokenizer.encode("<|user|>") == [tokenizer.token_id(USER)]  # plain `encode` still reads them


def test_the_loss_counts_the_assistant_content_and_its_end_token_only(tokenizer):
    template = ChatTemplate(tokenizer)
    ids, counted = template.encode_for_training(CONVERSATION)
    learnt = [i for i, c in zip(ids, counted, strict=True) if c]
    answers = [m.content for m in CONVERSATION if m.role == "assistant"]
    end = tokenizer.token_id(END_OF_TURN)
    expected = []
    for answer in answers:
        expected += tokenizer.encode_ordinary(answer) + [end]
    assert learnt == expected
    # The counted runs are exactly the assistant turns: each starts right after an <|assistant|>.
    starts = [i for i in range(1, len(ids)) if counted[i] and not counted[i - 1]]
    assert [ids[i - 1] for i in starts] == [tokenizer.token_id(ASSISTANT)] * 2


def test_masked_cross_entropy_equals_torch_on_the_counted_positions():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7))
    keep = torch.rand(3, 7) < 0.4
    ours = cross_entropy(logits, torch.where(keep, targets, IGNORE), ignore_index=IGNORE)
    (grad,) = torch.autograd.grad(ours, logits)
    oracle = F.cross_entropy(logits[keep], targets[keep])
    (oracle_grad,) = torch.autograd.grad(oracle, logits)
    torch.testing.assert_close(ours, oracle.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, oracle_grad, rtol=1e-5, atol=1e-7)
    assert (grad[~keep] == 0).all()


def test_loss_and_gradients_ignore_what_the_prompt_targets_are(tokenizer):
    """Changing the targets of the tokens the loss does not count (they are IGNORE in the batch; here they
    are replaced by arbitrary ids before masking) changes neither the loss nor any gradient."""
    template = ChatTemplate(tokenizer)
    encoded = encode_conversations([CONVERSATION], template, 64)
    inputs, targets = ConversationBatches(encoded).gather(np.array([0]), torch.device("cpu"))
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=tokenizer.vocab_size, context_length=64, d_model=32,
                                      num_layers=2, num_heads=4))  # fmt: skip
    results = []
    for seed in (1, 2):
        noise = torch.randint(
            0, tokenizer.vocab_size, targets.shape, generator=torch.Generator().manual_seed(seed)
        )
        varied = torch.where(targets == IGNORE, noise, targets)
        masked = torch.where(targets == IGNORE, IGNORE, varied)
        model.zero_grad()
        loss = cross_entropy(model(inputs), masked, ignore_index=IGNORE)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_no_conversation_sees_another_in_a_padded_batch(tokenizer):
    """Each row's logits equal those of its conversation alone: right padding is invisible to causal
    attention, so no token's loss depends on another conversation."""
    template = ChatTemplate(tokenizer)
    short = [Message("user", "Hi"), Message("assistant", "Hello")]
    encoded = encode_conversations([CONVERSATION, short], template, 64)
    batches = ConversationBatches(encoded)
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=tokenizer.vocab_size, context_length=64, d_model=32,
                                      num_layers=2, num_heads=4)).eval()  # fmt: skip
    inputs, targets = batches.gather(np.array([0, 1]), torch.device("cpu"))
    together = model(inputs)
    for row in (0, 1):
        alone_inputs, alone_targets = batches.gather(np.array([row]), torch.device("cpu"))
        width = alone_inputs.shape[1]
        torch.testing.assert_close(together[row, :width], model(alone_inputs)[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(targets[row, :width], alone_targets[0])
        assert (targets[row, width:] == IGNORE).all()
    assert batches.counted(np.array([0, 1])) == int((targets != IGNORE).sum())


def test_long_conversations_are_cut_at_a_turn_or_skipped(tokenizer):
    template = ChatTemplate(tokenizer)
    full, _ = template.encode_for_training(CONVERSATION)
    first_turn, _ = template.encode_for_training(CONVERSATION[:3])
    long_prompt = [Message("user", "word " * 200), Message("assistant", "ok")]
    context = len(first_turn) + 2  # fits the first exchange, not the whole
    assert len(full) > context + 1
    encoded = encode_conversations([CONVERSATION, long_prompt, CONVERSATION[:3]], template, context)
    assert (encoded.cut, encoded.skipped, len(encoded)) == (1, 1, 2)
    assert encoded.ids[encoded.offsets[0] : encoded.offsets[1]].tolist() == first_turn
    with pytest.raises(ScratchlmError, match="every conversation is longer than the context"):
        encode_conversations([long_prompt], template, context)


def _write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [', "not JSON"),
        ('{"conversation": []}', 'no "messages"'),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "unknown role 'bot'"),
        ('{"messages": [{"role": "user", "content": ""}]}', "message 1 \\(user\\) has empty content"),
        ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant turn"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}', "no text"),
    ],
)
def test_bad_conversation_lines_name_the_file_and_line(tmp_path, line, message):
    path = _write_lines(tmp_path / "chats.jsonl", [GOOD, "", line])
    with pytest.raises(ScratchlmError, match=f"chats.jsonl:3: .*{message}") as raised:
        read_conversations(path)
    assert "\n" not in str(raised.value)


def test_the_builtin_tasks_hold_out_their_test_questions():
    train, test = build_tasks(2000, 100, seed=3)
    assert len(train) == 2000 and len(test) == 100
    assert not {c[-2].content for c in test} & {c[-2].content for c in train}
    assert all(c[-1].role == "assistant" and c[-2].role == "user" for c in train + test)
    assert build_tasks(50, 5, seed=3) == (train[:50], test[:5])  # one seed, one set
