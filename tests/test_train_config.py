"""TrainConfig: TOML, overrides, validation, the resolved config written back; `scratchlm train` errors."""

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from scratchlm.errors import ScratchlmError
from scratchlm.training.config import TrainConfig
from scratchlm.training.config_reader import parse_override
from scratchlm.training.start import config_differences
from tests.helpers import PROJECT_ROOT

REQUIRED = ["data.train=t.npy", "data.valid=v.npy", "training.max_steps=10"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_file_then_overrides(tmp_path):
    path = write(
        tmp_path,
        '[data]\ntrain = "a.npy"\nvalid = "b.npy"\n[model]\nd_model = 64\nnum_heads = 4\n'
        "[optimizer]\nlr = 1\nbetas = [0.8, 0.9]\n[training]\nmax_steps = 5\n",
    )
    config = TrainConfig.load(
        path, ["optimizer.lr=3e-4", "training.device=cuda", "model.tie_embeddings=true"]
    )
    assert config.data.train == "a.npy"
    assert config.model.d_model == 64 and config.model.d_ff == 192  # default 8/3 · 64 rounded to 64
    assert config.optimizer.lr == 3e-4 and config.optimizer.betas == (0.8, 0.9)
    assert config.training.device == "cuda"  # not a TOML literal: read as a string
    assert config.model.tie_embeddings is True
    assert isinstance(TrainConfig.load(path).optimizer.lr, float)  # lr = 1 is a number


def test_resolved_toml_reads_back_to_the_same_config():
    config = TrainConfig.load(None, [*REQUIRED, 'data.tokenizer=tok dir/"x"', "optimizer.betas=[0.9, 0.999]"])
    text = config.to_toml()
    expected = config.to_dict()  # TOML has lists where the config has tuples
    expected["optimizer"]["betas"] = [0.9, 0.999]
    expected["lora"]["targets"] = list(expected["lora"]["targets"])
    expected["lora"]["train"] = list(expected["lora"]["train"])
    assert tomllib.loads(text) == expected
    assert TrainConfig.from_dict(tomllib.loads(text)) == config
    assert list(expected)[0] == "data" and "sft" not in expected  # one stage's section: pretraining's


def test_a_config_holds_one_stage_and_a_record_of_another_is_no_change():
    import scratchlm.chat.sft  # noqa: F401  (registers [sft])
    from scratchlm.training.start import config_changes

    with pytest.raises(ScratchlmError, match=r"\[data\] and \[sft\] are different stages' sections"):
        TrainConfig.from_dict({"data": {"train": "a", "valid": "b"}, "sft": {}, "training": {"max_steps": 1}})
    config = TrainConfig.load(None, [*REQUIRED])
    assert config.stage_name == "data" and config.data.train
    recorded = config.to_dict() | {"sft": {"base": "", "train": ""}}  # as configs recorded every stage's
    assert config_changes(recorded, config) == []
    assert config_changes(config.to_dict() | {"data": {"train": "other.npy"}}, config) != []


def test_token_budget_gives_the_number_of_steps():
    config = TrainConfig.load(
        None, ["data.train=t", "data.valid=v", "training.max_tokens=1000000", "training.batch_size=32"]
    )
    assert config.total_steps == 123  # ceil(1e6 / (32 × 256))


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=fast", r"optimizer\.lr must be a number, got 'fast'"),
        ("training.compile=1", r"training\.compile must be true or false, got 1"),
        ("training.batch_size=1.5", r"training\.batch_size must be an integer, got 1\.5"),
        (
            "training.precision=fp8",
            r"training\.precision must be one of 'auto', 'fp32', 'bf16', 'fp16', got 'fp8'",
        ),
        ("optimizer.betas=[0.9]", r"optimizer\.betas must be a list of 2 numbers"),
        ("model.d_model=-3", r"model\.d_model must be a positive integer"),
        ("training.batch_size=0", r"training\.batch_size must be positive"),
        ("optimizer.betas=[0.9, 1.0]", r"optimizer\.betas must lie in \[0, 1\)"),
        ("training.max_tokens=100", "set exactly one of training.max_steps and training.max_tokens"),
        (
            "training.grad_accum=3",
            r"training\.batch_size \(32\) must be divisible by training\.grad_accum \(3\)",
        ),
        ("model.colour=1", r"unknown key\(s\) model\.colour; \[model\] accepts: vocab_size, context_length"),
        ("optimiser.lr=1", r"unknown section\(s\) optimiser; known: data, model, optimizer"),
        ("lr=1", r"override 'lr=1' must look like section\.key=value"),
    ],
)
def test_bad_values_name_the_key_and_the_expectation(override, message):
    with pytest.raises(ScratchlmError, match=message):
        TrainConfig.load(None, [*REQUIRED, override])


def test_an_override_error_names_the_override_not_the_file(tmp_path):
    path = write(tmp_path, "[data]\ntrain = 'a.npy'\nvalid = 'b.npy'\n[training]\nmax_steps = 1\n")
    with pytest.raises(ScratchlmError) as error:
        TrainConfig.load(path, ["optimizer.lr=fast"])
    assert str(error.value).startswith("--set optimizer.lr=fast: optimizer.lr must be a number")
    assert str(path) not in str(error.value)
    with pytest.raises(ScratchlmError, match=r"^--set model\.colour=1: unknown key"):
        TrainConfig.load(path, ["model.colour=1"])
    # A check across keys that an override breaks names both sources.
    with pytest.raises(ScratchlmError, match=r"config\.toml with --set overrides: set exactly one of"):
        TrainConfig.load(path, ["training.max_tokens=100"])


def test_a_config_path_that_is_a_directory_or_not_utf8_is_one_line(tmp_path):
    with pytest.raises(ScratchlmError, match=r"config file .* is a directory; expected a TOML file"):
        TrainConfig.load(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("[data]\ntrain = 'caf\u00e9.npy'\n".encode("latin-1"))
    with pytest.raises(ScratchlmError, match=r"latin1\.toml is not UTF-8 text \(byte 19\)"):
        TrainConfig.load(latin1)


def test_data_files_are_required():
    with pytest.raises(ScratchlmError, match=r"data\.train is required"):
        TrainConfig.load(None, ["training.max_steps=1"])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ScratchlmError, match=r"nope\.toml not found"):
        TrainConfig.load(tmp_path / "nope.toml")
    with pytest.raises(ScratchlmError, match=r"config\.toml is not valid TOML"):
        TrainConfig.load(write(tmp_path, "[data\ntrain = 1"))
    with pytest.raises(ScratchlmError, match=r"config\.toml: data\.train must be a string, got 1"):
        TrainConfig.load(write(tmp_path, "[data]\ntrain = 1"))


def test_parse_override_reads_toml_literals():
    assert parse_override("a.b=3") == ("a", "b", 3)
    assert parse_override("a.b = [1, 2]") == ("a", "b", [1, 2])
    assert parse_override('a.b="x=y"') == ("a", "b", "x=y")
    assert parse_override("a.b=runs/x") == ("a", "b", "runs/x")


def test_shipped_tiny_config_is_valid():
    config = TrainConfig.load(PROJECT_ROOT / "configs" / "tiny.toml")
    assert config.total_steps == 200


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scratchlm", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    result = run_cli("--config", str(write(tmp_path, "[training]\nmax_step = 3\n")), cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.max_step" in lines[0] and "max_steps" in lines[0]


def test_cli_reports_a_bad_data_file_in_one_line(tmp_path):
    np.save(tmp_path / "t.npy", np.array([1, 2, 300] * 20, dtype=np.uint16))
    result = run_cli(
        "--set", "data.train=t.npy", "--set", "data.valid=t.npy", "--set", "training.max_steps=1",
        "--set", "model.vocab_size=256", "--set", "model.context_length=8", "--set", "logging.run_dir=run",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "t.npy has id 300 at position 2" in lines[0]


def test_two_spellings_of_one_path_are_no_difference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recorded = {"data": {"train": "t.npy", "valid": "v.npy", "tokenizer": "tok"}}
    same = {"data": {"train": str(tmp_path / "t.npy"), "valid": "./v.npy", "tokenizer": "tok/"}}
    assert config_differences(recorded, same, changeable=()) == []
    other = {"data": {"train": str(tmp_path / "u.npy"), "valid": "v.npy", "tokenizer": ""}}
    assert config_differences(recorded, other, changeable=()) == [
        ("data.train", "t.npy", str(tmp_path / "u.npy")),
        ("data.tokenizer", "tok", ""),
    ]


def test_config_differences_by_section_and_with_keys_that_may_change():
    data = {"train": "t.npy", "valid": "v.npy"}
    base = {"data": data, "training": {"max_steps": 10}}
    recorded = {**base, "model": {"num_layers": 2, "attention": "torch"}, "optimizer": {"lr": 1e-3}}
    current = TrainConfig.from_dict({**base, "model": {"num_layers": 3}, "optimizer": {"lr": 3e-4}})
    # every section, with the keys a resumed run may change left out (model.attention is one)
    assert config_differences(recorded, current) == [
        ("model.num_layers", 2, 3), ("optimizer.lr", 1e-3, 3e-4)
    ]  # fmt: skip
    # the model alone, each field compared (what training.init_from checks)
    assert config_differences(recorded, current, sections=("model",), changeable=()) == [
        ("model.num_layers", 2, 3), ("model.attention", "torch", None)
    ]  # fmt: skip
    # a recorded key the record lacks counts as its default: the spec's lr is not a change from itself
    assert config_differences(base, TrainConfig.from_dict(base), changeable=()) == []


def test_reading_a_config_imports_no_parallelism():
    """The config names the kinds of parallelism (scratchlm.parallelisms) without importing them: reading one
    loads neither scratchlm.parallel nor FSDP, and pretraining's section is known all the same."""
    code = (
        "import sys; from scratchlm.training.config import TrainConfig; "
        "print(TrainConfig().stage_name, sorted({'scratchlm.parallel', 'torch.distributed.fsdp'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["data", "[]"]
