"""lm-evaluation-harness tasks made from held-out text, for models of a corpus no public benchmark covers (the
quickstart's Python sources, or your own text): three local tasks, one of each kind of request the harness
makes, written as YAML + JSONL into a directory that `--include-path` reads.

    heldout_next_line    multiple choice: after a few lines of a document, which of four lines comes next
                         (the true one, and three lines drawn from other documents); `acc`
    heldout_perplexity   perplexity of whole documents, windowed over the context (loglikelihood_rolling);
                         `bits_per_byte` and `byte_perplexity` (words mean little in code)
    heldout_complete     generation: after a few lines and the first half of the next, its second half,
                         greedy, up to the newline; `exact_match`

Documents are separated by `<|endoftext|>`, as in the quickstart's `corpus/valid.txt`. Everything is drawn
with a fixed seed, so the same file gives the same tasks.

    python experiments/heldout_tasks.py runs/quickstart/corpus/valid.txt tasks/
    scratchlm eval --run runs/quickstart/run --tasks heldout_next_line,heldout_perplexity,heldout_complete \\
        --include-path tasks/
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
CONTEXT_LINES = 4
MIN_LINE_CHARS = 16  # lines shorter than this say too little to choose between
DOCUMENT_CHARS = 4000  # perplexity documents are cut to this many characters

TASKS = {
    "heldout_next_line": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "heldout_perplexity": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
""",
    "heldout_complete": """output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{rest}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 48
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def documents(path: Path) -> list[list[str]]:
    """The documents of `path`, each as its lines."""
    text = path.read_text(encoding="utf-8")
    return [doc.strip("\n").split("\n") for doc in text.split(END_OF_TEXT) if doc.strip()]


def make_docs(docs: list[list[str]], count: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    # (document, line) of every line that can be asked about: long enough, after enough lines of context
    places = [
        (d, i)
        for d, lines in enumerate(docs)
        for i in range(CONTEXT_LINES, len(lines))
        if len(lines[i].strip()) >= MIN_LINE_CHARS
    ]
    if len(places) < count or len(docs) < 2:
        raise SystemExit(f"too little text: {len(places)} usable lines in {len(docs)} documents")
    choice, complete = [], []
    for d, i in rng.sample(places, 2 * count):
        lines = docs[d]
        context = "\n".join(lines[i - CONTEXT_LINES : i]) + "\n"
        if len(choice) < count:
            others = [docs[od][oi] for od, oi in rng.sample(places, 12) if od != d][:3]
            options = [lines[i], *others]
            rng.shuffle(options)
            choice.append({"context": context, "choices": options, "label": options.index(lines[i])})
        else:
            cut = len(lines[i]) // 2
            complete.append({"context": context + lines[i][:cut], "rest": lines[i][cut:]})
    texts = ["\n".join(lines)[:DOCUMENT_CHARS] for lines in rng.sample(docs, min(count // 4, len(docs)))]
    return {
        "heldout_next_line": choice,
        "heldout_perplexity": [{"text": text} for text in texts],
        "heldout_complete": complete,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", type=Path, help="held-out text, documents separated by <|endoftext|>")
    parser.add_argument("out", type=Path, help="directory for the tasks (YAML + JSONL)")
    parser.add_argument("--count", type=int, default=200, help="questions per task (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, docs in make_docs(documents(args.text), args.count, args.seed).items():
        data = args.out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
        (args.out / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data.resolve()))}\n"
            f"test_split: test\n{TASKS[name]}",
            encoding="utf-8",
        )
        print(f"{name}: {len(docs)} documents -> {data}")


if __name__ == "__main__":
    main()
