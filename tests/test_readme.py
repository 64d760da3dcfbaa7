"""The README and the pages of docs/ show commands that run: every `scratchlm` command in their shell blocks names
a real sub-command with flags that parse (`doc_commands`), every `python PATH.py` names a file, and the README
keeps the shape that CI and a newcomer rely on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from doc_commands import check, commands, parse_cli
from helpers import PROJECT_ROOT

DOCUMENTS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
README = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(PROJECT_ROOT)))
def test_every_command_of_a_document_parses(document: Path) -> None:
    problems = check(document.read_text(encoding="utf-8"), PROJECT_ROOT)
    assert not problems, f"{document.relative_to(PROJECT_ROOT)}:\n" + "\n".join(problems)


def test_the_readme_shows_the_commands_a_newcomer_runs_next() -> None:
    shown = {parse_cli(argv[1:]).command for c in commands(README) if (argv := c.argv)[0] == "scratchlm"}
    assert {"quickstart", "generate", "chat", "serve", "train", "export"} <= shown
    assert any(c.text.startswith("torchrun ") and " -m scratchlm train " in c.text for c in commands(README))


def test_the_readme_fits_in_a_few_screens() -> None:
    assert len(README.splitlines()) <= 250


def test_the_quickstart_block_is_the_one_ci_runs() -> None:
    """`.ci/run` reads the second line of the Quickstart's first block as the test command: the block holds
    exactly the install-and-quickstart line and the install-and-test line."""
    block = re.search(r"^## Quickstart\s*$.*?^```[a-z]*\n(.*?)^```", README, re.M | re.S)
    assert block is not None
    lines = [line for line in block[1].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines == [
        "pip install torch==2.13.0 -e . && scratchlm quickstart",
        'pip install torch==2.13.0 -e ".[test]" && python -m pytest -n 2',
    ]


def test_every_link_to_a_file_of_the_repository_resolves() -> None:
    """Relative links of the README and docs/ (the sections that left the README took their links along)."""
    broken = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"", text):
            target = next(t for t in target if t)
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path):
                continue
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists():
                broken.append(f"{document.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{document.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


# The checker itself, on documents with known mistakes: each must be caught, and nothing else.
MISTAKES = """\
Some prose with `scratchlm genrate` in it, which is not a command line.

```bash
pip install torch -e . && scratchlm quickstart --smal        # an abbreviation: it runs, but is no flag name
scratchlm genrate --run runs/x
scratchlm generate --run runs/x --max-tokens 5 \\
    --top-p 0.9
torchrun --nproc_per_node 2 -m scratchlm train --confg configs/tiny.toml
python benchmarks/bench_nope.py --runs 3
scratchlm export --run runs/x --format hf --out exports/x [--dtyp f16]
SCRATCHLM_DEVICE_PROFILE=p.json python -m scratchlm doctor --jsn
scratchlm serve --run runs/x & scratchlm eval --rn runs/x 2>&1 | tee log
```

```text
$ scratchlm doctr
scratchlm not-a-command: output, not a command
```

```python
scratchlm.generate(model, ids)  # Python, not shell
```
"""
CORRECT = """\
```bash
pip install torch==2.13.0 -e . && scratchlm quickstart --small   # a comment --not-a-flag
scratchlm generate --run runs/x --prompt "def f(x):  # not a comment" --max-new-tokens 5 \\
    --top-p 0.9 [--top-k K] [--seed S]
torchrun --nproc_per_node 2 -m scratchlm train --config configs/tiny.toml --set training.max_steps=10
python benchmarks/bench_train_bpe.py --runs 3
SCRATCHLM_DEVICE_PROFILE=p.json python -m scratchlm doctor --json
scratchlm serve --run runs/x & scratchlm eval --run runs/x --data v.npy 2>&1 | tee log
scratchlm train --help
```

```text
$ scratchlm doctor
device    cpu
```
"""


def test_the_checker_catches_each_kind_of_mistake() -> None:
    problems = check(MISTAKES, PROJECT_ROOT)
    expected = [
        (4, "unrecognized arguments: --smal"),
        (5, "invalid choice: 'genrate'"),
        (6, "unrecognized arguments: --max-tokens 5"),
        (8, "unrecognized arguments: --confg"),
        (9, "benchmarks/bench_nope.py does not exist"),
        (10, "scratchlm export has no flag --dtyp"),
        (11, "unrecognized arguments: --jsn"),
        (12, "one of the arguments --run --checkpoint is required"),
        (16, "invalid choice: 'doctr'"),
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for problem, (line, message) in zip(problems, expected, strict=True):
        assert problem.startswith(f"line {line}: ") and message in problem, problem


def test_the_checker_passes_correct_commands() -> None:
    assert check(CORRECT, PROJECT_ROOT) == []
    assert [c.argv[:2] for c in commands(CORRECT)] == [
        ["pip", "install"],
        ["scratchlm", "quickstart"],
        ["scratchlm", "generate"],
        ["torchrun", "--nproc_per_node"],
        ["python", "benchmarks/bench_train_bpe.py"],
        ["SCRATCHLM_DEVICE_PROFILE=p.json", "python"],
        ["scratchlm", "serve"],
        ["scratchlm", "eval"],
        ["tee", "log"],
        ["scratchlm", "train"],
        ["scratchlm", "doctor"],
    ]


def test_a_command_splits_as_bash_splits_it() -> None:
    """The oracle for the splitting (quotes, a `#` inside them, a continued line): bash's own arguments."""
    generate = next(c for c in commands(CORRECT) if c.text.startswith("scratchlm generate"))
    written = "\n".join(CORRECT.splitlines()[2:4])  # the command's two lines as the document has them
    assert written.startswith("scratchlm generate") and written.endswith("[--seed S]")
    without_optional = re.sub(r" \[[^\]]*\]", "", written)
    shell = subprocess.run(
        ["bash", "-c", f'set -- {without_optional}\nprintf "%s\\n" "$@"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert generate.argv == shell.stdout.splitlines()
    assert generate.optional == ("--top-k K", "--seed S")
