"""lm-evaluation-harness in-process: a scratchlm model as one of the harness's `LM`s, so that any of its tasks
(multiple choice, perplexity, generation) scores the model with no server in between.

The harness asks three kinds of question, and each is answered the way its `hf` model answers them:

    loglikelihood(context, continuation)   log P(continuation | context), and whether greedy decoding would
                                           have produced the continuation: one forward pass over the last
                                           `context_length + 1` tokens of context + continuation; requests
                                           are sorted by length and run `batch_size` at a time, padded on the
                                           right (causal attention never looks at the padding)
    loglikelihood_rolling(text)            log P(text), the text cut into disjoint windows of the context's
                                           length, each predicted after the token before it (the first after
                                           end-of-text), as the harness's `get_rolling_token_windows` cuts it
    generate_until(context, until, ...)    a completion that ends at the first `until` string, at
                                           end-of-text or after `max_gen_toks` tokens: the batched engine's
                                           batching runs every request together

The model computes in the dtype its weights are held in (the device plan's precision:
`prepare_for_inference`); log-probabilities are taken in float32. lm-eval is the optional extra `scratchlm[eval]`; `scratchlm eval
--tasks` is the way in.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from scratchlm.generation.engine import Failed, Finished, SequenceRequest, Token
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.model.transformer import TransformerLM
from scratchlm.serving.engine import Engine
from scratchlm.serving.text import CompletionText
from scratchlm.tokenizer.tokenizer import Tokenizer


class ScratchlmLM(TemplateLM):
    """`model` and `tokenizer` as lm-evaluation-harness's `LM`, `batch_size` sequences a forward pass."""

    def __init__(self, model: TransformerLM, tokenizer: Tokenizer, batch_size: int = 16) -> None:
        super().__init__()
        if tokenizer.eos_id is None:
            raise ValueError("lm-evaluation-harness needs an end-of-text token, and this tokenizer has none")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.context_length = model.config.context_length
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        return list(self._score(pairs))

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> Iterator[tuple[float, bool]]:
        """(log P(continuation | context), greedy?) of each pair, in order."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        results: dict[int, tuple[float, bool]] = {}
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            windows = [(pairs[i][0] + pairs[i][1])[-(self.context_length + 1) :] for i in batch]
            inputs = torch.zeros(len(batch), max(map(len, windows)) - 1, dtype=torch.long)
            for row, window in enumerate(windows):
                inputs[row, : len(window) - 1] = torch.tensor(window[:-1])
            with torch.inference_mode():
                logprobs = torch.log_softmax(self.model(inputs.to(self._device)).float(), dim=-1).cpu()
            for row, (i, window) in enumerate(zip(batch, windows, strict=True)):
                n = len(pairs[i][1])
                positions = torch.arange(len(window) - 1 - n, len(window) - 1)
                targets = torch.tensor(window[-n:])
                rows = logprobs[row, positions]
                score = float(rows.gather(-1, targets[:, None]).sum())
                results[i] = (score, bool((rows.argmax(-1) == targets).all()))
        return (results[i] for i in range(len(pairs)))

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in requests:
            (text,) = request.args
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.context_length,
                    context_len=1,
                )
            ]
            totals.append(sum(score for score, _ in self._score(windows)))
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        return asyncio.run(self._generate([request.args for request in requests]))

    async def _generate(self, requests: list[tuple[str, dict]]) -> list[str]:
        engine = Engine(self.model, self.eot_token_id)
        engine.start()
        try:
            texts: list[str] = []
            for start in range(0, len(requests), engine.max_queue):
                chunk = requests[start : start + engine.max_queue]
                stops = [self._stops(kwargs) for _, kwargs in chunk]
                sequences = engine.submit(
                    [self._sequence_request(engine, context, kwargs) for context, kwargs in chunk]
                )
                for sequence, stop in zip(sequences, stops, strict=True):
                    texts.append(await self._completion(engine, sequence, stop))
            return texts
        finally:
            engine.stop()

    def _sequence_request(self, engine: Engine, context: str, kwargs: dict) -> SequenceRequest:
        max_tokens = int(kwargs.get("max_gen_toks", 256))
        # As the harness's `hf` model: the context is cut from the left to leave room for the completion.
        ids = self.tok_encode(context)[-max(1, self.context_length - max_tokens) :] or [self.eot_token_id]
        sampled = kwargs.get("do_sample", False) and kwargs.get("temperature", 1.0) > 0
        options = SamplingOptions(
            max_new_tokens=min(max_tokens, engine.budget(len(ids))),
            temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
            top_p=float(kwargs.get("top_p", 1.0)) if sampled else 1.0,
            seed=kwargs.get("seed"),
        )
        return SequenceRequest(ids, options)

    def _stops(self, kwargs: dict) -> list[str]:
        until = kwargs.get("until") or []
        return [until] if isinstance(until, str) else list(until)

    async def _completion(self, engine: Engine, sequence, stops: list[str]) -> str:
        """The text of `sequence` up to its first stop string (the sequence is cancelled there)."""
        text, pieces = CompletionText(self.tokenizer, tuple(stops), 0), []
        while True:
            event = await sequence.events.get()
            if isinstance(event, Failed):
                raise RuntimeError(event.message)
            if isinstance(event, Token) and event.token_id == self.eot_token_id:
                continue  # the end of the text, not part of it; `Finished` follows
            if isinstance(event, Token | Finished):
                piece, stopped = text.add(event.token_id if isinstance(event, Token) else None)
                pieces.append(piece)
                if stopped:
                    engine.cancel(sequence)
                if stopped or isinstance(event, Finished):
                    return "".join(pieces)


def evaluate_tasks(
    lm: ScratchlmLM,
    tasks: list[str],
    include_path: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `tasks` (names, or groups) on `lm`: its results dict (`results`,
    `n-shot`, `configs`, ... and `samples` with `log_samples`). `include_path` adds local YAML tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" or under {include_path}" if include_path else " (local tasks: --include-path DIR)"
        raise ValueError(f"no lm-eval task named {', '.join(unknown)}{where}")
    settings = {"limit": limit, "num_fewshot": num_fewshot, "log_samples": log_samples}
    import lm_eval.evaluator

    # lm-eval records the commit of the current directory's repository by running git, whose stderr is the
    # terminal's: outside a repository, a stray "fatal: not a git repository". The same query, quiet.
    with contextlib.ExitStack() as stack:
        if hasattr(lm_eval.evaluator, "get_git_commit_hash"):
            stack.enter_context(mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _git_commit))
        return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, **settings)


def _git_commit() -> str | None:
    """`git describe --always` in the current directory, or None (not a repository, no git), saying nothing."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def results_table(results: dict[str, Any]) -> str:
    """The results as lm-eval prints them: one row per task, metric and filter, with its standard error."""
    from lm_eval.utils import make_table

    return make_table(results)
