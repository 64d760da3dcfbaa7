"""lm-evaluation-harness scores a scratchlm model with no hand work: the real `lm_eval` command against a live
`scratchlm serve` with only the harness's defaults and `max_length`, and `scratchlm eval --tasks` in-process.

The three local tasks the tests build cover the harness's three kinds of request: multiple choice
(loglikelihood), rolling perplexity over documents longer than the context (loglikelihood_rolling) and greedy
generation up to a newline (generate_until). The oracle is the model's own computation in fp32, written here
from `torch.log_softmax` of its logits and `generate_stream`: each choice's log-likelihood, each document's
log-likelihood over the windows the harness cuts, each greedy completion.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm_eval not installed (pip install 'scratchlm[eval]')")
pytest.importorskip("starlette", reason="starlette not installed (pip install 'scratchlm[serve]')")
pytest.importorskip("openai", reason="openai not installed (the test oracle)")
from interop_helpers import run_cli  # noqa: E402
from serve_helpers import Running, run_lm_eval, tiny_run  # noqa: E402

from scratchlm.cli import main  # noqa: E402
from scratchlm.generation.generate import generate_stream  # noqa: E402
from scratchlm.run.load import load_trained  # noqa: E402
from scratchlm.tokenizer import END_OF_TEXT  # noqa: E402

CONTEXT = 32
QUESTIONS = [
    ("The cat sat on the", ["mat", "moon", "tree", "dog"]),
    ("Once upon a", ["time", "hill", "river", "day"]),
    ("She opened the", ["door", "box", "window", "book"]),
    ("It was a dark and stormy", ["night", "sea", "morning", "cat"]),
    ("1 2 3", ["4", "5", "6", "7"]),
    ("The sun rises in the", ["east", "west", "north", "south"]),
]
DOCUMENTS = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little.",
    "naïve café résumé — 東京の天気は晴れ。 Ünïcödé text whose windows start inside characters.",
]
PROMPTS = ["Once upon a time", "The cat sat", "She said that", "In the beginning", "A", "Then"]
MAX_GEN = 8


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("lm-eval") / "tiny-run", CONTEXT, seed=11)


@pytest.fixture(scope="module")
def trained(run_dir):
    return load_trained(run_dir)


def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    """log P(ids[i] | ids[:i]) for i >= 1, in float64 from the fp32 model (which reads all but the last)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), dim=-1)
    return logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def choice_loglikelihood(trained, question: str, choice: str) -> float:
    """The harness's split: the context's ids, then whatever the whole text adds after them."""
    context = trained.tokenizer.encode(question)
    whole = trained.tokenizer.encode(f"{question} {choice}")
    assert whole[: len(context)] == context
    return float(logprobs_of(trained.model, whole)[len(context) - 1 :].sum())


def document_loglikelihood(trained, text: str, window: int) -> float:
    """The document after end-of-text, predicted `window` tokens at a time, each stretch read by one pass of
    `window` tokens: a full stretch after the token before it, the last (shorter) one after as many tokens
    before it as the pass has room for."""
    ids = [trained.tokenizer.eos_id, *trained.tokenizer.encode(text)]
    assert len(ids) > 2 * window  # longer than the context: the windows matter
    total = 0.0
    for start in range(1, len(ids), window):
        end = min(start + window, len(ids))
        total += float(
            logprobs_of(trained.model, ids[max(0, end - 1 - window) : end])[-(end - start) :].sum()
        )
    return total


def greedy_line(trained, prompt: str) -> str:
    ids = []
    for token in generate_stream(
        trained.model,
        trained.tokenizer.encode(prompt),
        MAX_GEN,
        eos_id=trained.tokenizer.eos_id,
        temperature=0,
    ):
        if token == trained.tokenizer.eos_id:
            break
        ids.append(token)
    return trained.tokenizer.decode(ids).split("\n")[0]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, trained) -> Path:
    """Three local tasks. Every other generation task's answer is the model's greedy line, so exact match is
    1/2 exactly when the harness's generations are the model's."""
    directory = tmp_path_factory.mktemp("tasks")

    def write(name: str, docs: list[dict], config: str) -> None:
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        data = json.dumps(str(directory / f"{name}.jsonl"))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{config}"
        )

    write(
        "tiny_choice",
        [{"question": q, "choices": c, "label": i % 4} for i, (q, c) in enumerate(QUESTIONS)],
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n',
    )
    write(
        "tiny_rolling",
        [{"text": text} for text in DOCUMENTS],
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n",
    )
    write(
        "tiny_generation",
        [
            {"prompt": p, "answer": greedy_line(trained, p) if i % 2 == 0 else "zzz"}
            for i, p in enumerate(PROMPTS)
        ],
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    )
    return directory


TASKS = ["tiny_choice", "tiny_rolling", "tiny_generation"]


def check_scores(trained, results: dict, samples: dict, window: int) -> None:
    """The harness's numbers against the oracle's: each choice's log-likelihood and the accuracy, each
    document's log-likelihood and the word perplexity (within 1 %), each generation and exact match."""
    choice_docs = sorted(samples["tiny_choice"], key=lambda s: s["doc_id"])
    correct = 0
    for sample, (question, choices) in zip(choice_docs, QUESTIONS, strict=True):
        expected = [choice_loglikelihood(trained, question, c) for c in choices]
        got = [float(r[0][0]) for r in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-3)
        correct += max(range(4), key=expected.__getitem__) == sample["doc"]["label"]
    assert results["tiny_choice"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))

    expected_ll = [document_loglikelihood(trained, text, window) for text in DOCUMENTS]
    rolling = sorted(samples["tiny_rolling"], key=lambda s: s["doc_id"])
    assert [float(s["resps"][0][0]) for s in rolling] == pytest.approx(expected_ll, rel=1e-3)
    words = sum(len(text.split()) for text in DOCUMENTS)
    word_perplexity = math.exp(-sum(expected_ll) / words)
    assert results["tiny_rolling"]["word_perplexity,none"] == pytest.approx(word_perplexity, rel=0.01)

    generations = sorted(samples["tiny_generation"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in generations] == [greedy_line(trained, p) for p in PROMPTS]
    assert results["tiny_generation"]["exact_match,none"] == pytest.approx(0.5)


def newest_json(directory: Path, pattern: str) -> list[Path]:
    return sorted(directory.rglob(pattern), key=lambda p: p.stat().st_mtime)


def test_lm_eval_scores_the_server_with_its_defaults(trained, tasks_dir, tmp_path) -> None:
    """`lm_eval --model local-completions --model_args base_url=...,model=NAME,max_length=CTX`: the harness
    finds the server's tokenizer endpoints and sends token ids."""
    server = Running(trained, "tiny-run")
    try:
        out = tmp_path / "out"
        done = run_lm_eval(
            "--model", "local-completions",
            "--model_args", f"base_url={server.url}/v1/completions,model=tiny-run,max_length={CONTEXT}",
            "--tasks", ",".join(TASKS),
            "--include_path", str(tasks_dir),
            "--output_path", str(out),
        )  # fmt: skip
        assert "remote tokenizer" in done.stderr.lower()  # found by itself, not named
    finally:
        server.close()
    results = json.loads(newest_json(out, "results_*.json")[-1].read_text())["results"]
    samples = {
        task: [
            json.loads(line)
            for line in newest_json(out, f"samples_{task}_*.jsonl")[-1].read_text().splitlines()
        ]
        for task in TASKS
    }
    # The harness's API models keep one token of `max_length` for the one they ask to generate, and their
    # rolling windows one more for the token each window is read after.
    check_scores(trained, results, samples, window=CONTEXT - 2)


def test_scratchlm_eval_tasks_runs_the_harness_in_process(trained, run_dir, tasks_dir, capsys) -> None:
    status, out, err = run_cli(
        ["eval", "--run", str(run_dir), "--tasks", ",".join(TASKS), "--include-path", str(tasks_dir),
         "--precision", "fp32", "--batch-size", "4"],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    assert all(task in out for task in TASKS)  # the table
    written = newest_json(run_dir / "lm_eval", "results_*.json")[-1]
    results = json.loads(written.read_text())
    assert results["scratchlm"]["precision"] == "fp32"
    from scratchlm.harness import ScratchlmLM, evaluate_tasks

    logged = evaluate_tasks(
        ScratchlmLM(trained.model, trained.tokenizer, batch_size=4), TASKS, str(tasks_dir), log_samples=True
    )
    for task in TASKS:
        for metric in ("acc,none", "word_perplexity,none", "exact_match,none"):
            if metric in logged["results"][task]:
                assert results["results"][task][metric] == pytest.approx(logged["results"][task][metric])
    check_scores(trained, logged["results"], logged["samples"], window=CONTEXT)


def test_eval_tasks_outside_a_git_repository_prints_no_git_error(
    run_dir, tasks_dir, tmp_path, monkeypatch, capfd
) -> None:
    """lm-eval asks git for the current directory's commit; outside a repository git must not be heard."""
    monkeypatch.chdir(tmp_path)
    status = main(
        ["eval", "--run", str(run_dir), "--tasks", TASKS[0], "--include-path", str(tasks_dir),
         "--precision", "fp32", "--limit", "2"]
    )  # fmt: skip
    err = capfd.readouterr().err
    assert status == 0, err
    assert "fatal" not in err and "not a git repository" not in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--tasks", "no_such_task"], "no lm-eval task named no_such_task"),
        (["--tasks", "tiny_choice", "--include-path", "/nonexistent"], "not a directory"),
        (["--tasks", ","], "at least one task"),
    ],
)
def test_bad_tasks_are_one_line_errors(run_dir, argv, fragment, capsys) -> None:
    status, _, err = run_cli(["eval", "--run", str(run_dir), *argv], capsys)
    assert status == 2 and fragment in err and "Traceback" not in err


def test_without_lm_eval_the_command_says_what_to_install(run_dir, monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    status, _, err = run_cli(["eval", "--run", str(run_dir), "--tasks", "tiny_choice"], capsys)
    assert status == 2 and 'pip install "scratchlm[eval]"' in err


def test_heldout_tasks_ask_about_the_text_they_were_made_from(tmp_path) -> None:
    """experiments/heldout_tasks.py: each question's answer is the line that follows its context in a document
    of the text."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    try:
        import heldout_tasks
    finally:
        sys.path.pop(0)
    docs = [
        [f"document {d} line {i}: {'x' * (i % 5)} value = {d * 100 + i}" for i in range(30)] for d in range(8)
    ]
    text = tmp_path / "valid.txt"
    text.write_text(END_OF_TEXT.join("\n".join(lines) + "\n" for lines in docs), encoding="utf-8")
    made = heldout_tasks.make_docs(heldout_tasks.documents(text), count=20, seed=1)
    for question in made["heldout_next_line"]:
        answer = question["choices"][question["label"]]
        d, i = (int(part) for part in answer.split(":")[0].removeprefix("document ").split(" line "))
        assert question["context"] == "\n".join(docs[d][i - heldout_tasks.CONTEXT_LINES : i]) + "\n"
        assert len(set(question["choices"])) == 4
    for question in made["heldout_complete"]:
        line = question["context"].split("\n")[-1] + question["rest"]
        assert any(line in lines for lines in docs)
    assert all(doc["text"] in text.read_text() for doc in made["heldout_perplexity"])
