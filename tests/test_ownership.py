"""Who owns what: inference never imports training, the training loop never imports a stage built on it (chat),
and checkpoints written by earlier code still load."""

from __future__ import annotations

from pathlib import Path

import torch
from imports import PACKAGE, imported_modules, module_file

from scratchlm.run import Checkpoint, load_trained
from scratchlm.run.checkpoint import read_checkpoint

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run-main"
# The inference side: reading runs, generating, converting, and the commands that do only that.
INFERENCE = [
    "run",
    "generation",
    "interop",
    "serving",
    "evaluation.py",
    "harness.py",
    "cli/generate.py",
    "cli/eval.py",
    "cli/export.py",
    "cli/import_hf.py",
    "cli/import_gguf.py",
    "cli/serve.py",
]


def reached(start: list[Path], forbidden: str) -> tuple[set[str], dict[Path, str]]:
    """Every chain of imports from the files `start` through the package that reaches `forbidden` (a package
    name), as "first file -> ... -> module", and the files the walk went through."""
    seen: dict[Path, str] = {path: str(path.relative_to(PACKAGE)) for path in start}
    queue = list(start)
    arrows = set()
    while queue:
        path = queue.pop()
        for module in imported_modules(path):
            if module == forbidden or module.startswith(forbidden + "."):
                arrows.add(f"{seen[path]} -> {module}")
            target = module_file(module)
            if target is not None and target not in seen:
                seen[target] = f"{seen[path]} -> {target.relative_to(PACKAGE)}"
                queue.append(target)
    return arrows, seen


def test_no_inference_module_imports_training_even_through_another():
    """Follows every import from the inference side through the package (the model, the tokenizer, ...):
    no chain of imports reaches scratchlm.training."""
    start = [
        p
        for part in INFERENCE
        for p in ([PACKAGE / part] if part.endswith(".py") else (PACKAGE / part).rglob("*.py"))
    ]
    assert len(start) > 10
    arrows, seen = reached(start, "scratchlm.training")
    assert arrows == set()
    assert PACKAGE / "model" / "transformer.py" in seen  # the walk did follow imports


def test_the_training_loop_imports_no_stage_built_on_it():
    """The loop reaches its batches and its loss through `scratchlm.training.stage` alone: no module of
    scratchlm/training imports scratchlm.chat (the stages built on the loop register themselves). The chat
    template, which inference reads too, may be reached through the modules below the loop."""
    files = sorted((PACKAGE / "training").rglob("*.py"))
    assert len(files) > 10
    found = {
        f"{path.relative_to(PACKAGE)} -> {module}"
        for path in files
        for module in imported_modules(path)
        if module == "scratchlm.chat" or module.startswith("scratchlm.chat.")
    }
    assert found == set()


def test_the_walk_sees_an_import_inside_a_function(tmp_path):
    (tmp_path / "scratchlm").mkdir()
    source = tmp_path / "scratchlm" / "m.py"
    source.write_text("def f():\n    from scratchlm.training.optim import AdamW\n")
    assert "scratchlm.training.optim" in imported_modules(source, tmp_path / "scratchlm")


def test_a_checkpoint_written_by_earlier_code_still_loads(tmp_path):
    """`run-main` was written by the trainer before checkpoints were typed: it loads through `Checkpoint` and
    `load_trained`, and the weights are exactly the tensors in the file."""
    path = FIXTURE / "checkpoints" / "step_00000003.pt"
    raw = torch.load(path, map_location="cpu", weights_only=True)
    checkpoint = Checkpoint.read(path)
    assert checkpoint.step == raw["iteration"] == 3
    assert checkpoint.model_config.vocab_size == 32 and checkpoint.training.time_budget is None
    assert checkpoint.training.precision == "fp32" and checkpoint.optimizer is not None
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
