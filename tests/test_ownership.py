"""Who owns what: inference never imports training, and checkpoints written by earlier code still load."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from scratchlm.run import Checkpoint, load_trained
from scratchlm.run.checkpoint import read_checkpoint

PACKAGE = Path(__file__).resolve().parent.parent / "scratchlm"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run-main"
# The inference side: reading runs, generating, converting, and the commands that do only that.
INFERENCE = [
    "run",
    "generation",
    "interop",
    "cli/generate.py",
    "cli/eval.py",
    "cli/export.py",
    "cli/import_hf.py",
]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_inference_module_imports_training():
    files = [
        p
        for part in INFERENCE
        for p in ([PACKAGE / part] if part.endswith(".py") else (PACKAGE / part).rglob("*.py"))
    ]
    assert len(files) > 10
    arrows = {
        f"{path.relative_to(PACKAGE)} -> {module}"
        for path in files
        for module in imported_modules(path)
        if module == "scratchlm.training" or module.startswith("scratchlm.training.")
    }
    assert arrows == set()


def test_the_walk_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from scratchlm.training.optim import AdamW\n")
    assert "scratchlm.training.optim" in imported_modules(source)


def test_a_checkpoint_written_by_earlier_code_still_loads(tmp_path):
    """`run-main` was written by the trainer before checkpoints were typed: it loads through `Checkpoint` and
    `load_trained`, and the weights are exactly the tensors in the file."""
    path = FIXTURE / "checkpoints" / "step_00000003.pt"
    raw = torch.load(path, map_location="cpu", weights_only=True)
    checkpoint = Checkpoint.read(path)
    assert checkpoint.step == raw["iteration"] == 3
    assert checkpoint.model_config.vocab_size == 32 and checkpoint.time_budget is None
    assert checkpoint.precision == "fp32" and checkpoint.optimizer is not None
    trained = load_trained(FIXTURE)
    assert trained.checkpoint == path
    state = trained.model.state_dict()
    assert state.keys() == raw["model"].keys()
    assert all(torch.equal(state[name], raw["model"][name]) for name in state)
    # Written again by today's code, it reads back to the same content, with the same checksum rule.
    checkpoint.save(tmp_path / "again.pt")
    again = read_checkpoint(tmp_path / "again.pt")
    assert again.keys() == raw.keys() - {"sha256"}
    assert all(torch.equal(again["model"][name], raw["model"][name]) for name in raw["model"])
    assert again["train_config"] == raw["train_config"] and again["elapsed_s"] == raw["elapsed_s"]
