"""On a CUDA device (marker `gpu`; skipped elsewhere): the whole model with the compiled Triton kernel against
the blocked tensor implementation, in bfloat16 autocast, and compiled training steps that learn."""

import dataclasses

import pytest
import torch
from helpers import assert_same_gradients

from scratchlm import ModelConfig, TransformerLM
from scratchlm.model.loss import cross_entropy
from scratchlm.training.optim import AdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA"),
]

CONFIG = ModelConfig(
    vocab_size=512, context_length=256, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2
)


def pair() -> tuple[TransformerLM, TransformerLM]:
    torch.manual_seed(0)
    kernel = TransformerLM.from_config(dataclasses.replace(CONFIG, attention="triton")).cuda()
    blocked = TransformerLM.from_config(dataclasses.replace(CONFIG, attention="torch")).cuda()
    blocked.load_state_dict(kernel.state_dict())
    return kernel, blocked


def test_model_logits_and_gradients_with_the_kernel_equal_the_tensor_implementation():
    kernel, blocked = pair()
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 255), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, expected = kernel(tokens).float(), blocked(tokens).float()
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=5e-2)
    logits.square().mean().backward()
    expected.square().mean().backward()
    assert_same_gradients(kernel, blocked, atol=5e-3, rtol=5e-2)


def test_compiled_training_steps_learn():
    kernel, _ = pair()
    compiled = torch.compile(kernel, fullgraph=True)
    optimizer = AdamW(kernel.parameters(), lr=3e-3)
    tokens = torch.randint(0, CONFIG.vocab_size, (8, 257), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(compiled(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_compiled_decode_steps_replayed_as_cuda_graphs_give_the_eager_tokens():
    """The decode step compiled with CUDA graphs (`scratchlm.generation.decode`) at batch 1 and at a batch of
    three rows of different lengths: fp32 greedy tokens equal the eager ones; the cache's tensors are written in
    place by the replayed graph."""
    from scratchlm.generation.generate import generate

    torch.manual_seed(0)
    model = TransformerLM.from_config(dataclasses.replace(CONFIG, attention="torch")).cuda().eval()
    prompts = torch.randint(0, CONFIG.vocab_size, (3, 7), device="cuda")
    for batch in (prompts[:1], prompts):
        eager = generate(model, batch, 40, temperature=0, compile=False)
        compiled = generate(model, batch, 40, temperature=0, compile=True)
        assert compiled == eager
    from scratchlm.generation.engine import Sequence, SequenceRequest
    from scratchlm.generation.sampling import SamplingOptions
    from scratchlm.serving.engine import Engine

    engine = Engine(model, None, max_batch=4, compiled=True)
    batch = engine.batch
    assert not batch.decoder.background  # on a GPU a step compiles at its first call, in the serving thread
    options = SamplingOptions(max_new_tokens=6, temperature=0.0)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4):
            requests = [SequenceRequest(prompts[row, : 3 + row].tolist(), options) for row in range(rows)]
            batch.advance(
                [Sequence(r, options.generator(batch.device), lambda event: None) for r in requests]
            )
            while batch.active:
                batch.advance([])
    assert all(batch.decoder.is_compiled_for(rows) for rows in (1, 2, 3, 4))
