"""The fast recipe's shape for the steps a budget buys: the count by hand, the ladder's choice at its edges, and
the quickstart's choice with the device mocked both ways (a slow fp32 CPU, a fast bf16 one), recorded in the
run and kept when the run resumes on a machine that measures otherwise."""

import json
from pathlib import Path

import pytest

from scratchlm.data.prepare import PreparedData
from scratchlm.device import planning
from scratchlm.device.profile import DeviceProfile
from scratchlm.model.accounting import train_step_flops
from scratchlm.quickstart import FAST_SHAPES, FULL, choose_fast_shape, train_config
from scratchlm.run import RunDirectory
from scratchlm.training.sizing import STEP_EFFICIENCY, Shape, budget_steps, choose_shape

DATA = PreparedData(Path("tok"), Path("train.npy"), Path("valid.npy"))


def config_of(shape: Shape, seconds: float = 240.0):
    return train_config(FULL, DATA, Path("run"), seconds, "cpu", 0, "fast", shape)


def cpu(name: str, **gflops: float) -> DeviceProfile:
    return DeviceProfile(
        type="cpu", name=name, native_bf16="bf16" in gflops, matmul_gflops={"fp32": 1.0} | gflops
    )


@pytest.fixture
def mocked_device(monkeypatch):
    def use(profile: DeviceProfile) -> None:
        monkeypatch.setattr(planning, "device_profile", lambda device, refresh=False: profile)

    return use


def test_the_steps_a_budget_buys_by_hand() -> None:
    # The quickstart's smallest shape, per token of a forward pass: each of 2 layers 4 projections 256 x 256
    # (2 * 4 * 65,536 FLOPs), the feed-forward's two 256 x 1,024 (2 * 2 * 262,144), the scores and the weighted
    # sum over 256 positions (2 * 2 * 256 * 256); then the head, 256 x 4,096 (2 * 1,048,576). A training step is
    # three forward passes' worth, over 8 sequences of 256 tokens.
    per_layer = 2 * 4 * 65_536 + 2 * 2 * 262_144 + 2 * 2 * 256 * 256
    step = 3 * (2 * per_layer + 2 * 1_048_576) * 8 * 256
    assert step == 35_433_480_192
    smallest = config_of(FAST_SHAPES[0])
    # 60 s at 100 GFLOP/s, of which a step reaches STEP_EFFICIENCY.
    assert budget_steps(smallest, 60.0, 100.0) == int(60.0 * STEP_EFFICIENCY * 100e9 / step)
    assert budget_steps(smallest, 120.0, 100.0) == int(120.0 * STEP_EFFICIENCY * 100e9 / step)


def test_the_ladder_takes_the_largest_shape_that_gets_the_steps_it_needs() -> None:
    small, middle, large = (
        Shape("small", {"training": {"batch_size": 8}}),
        Shape("middle", {"training": {"batch_size": 16}}, min_steps=100),
        Shape(
            "large", {"model": {"num_layers": 4, "value_embeddings": 2}, "training": {"batch_size": 16}}, 100
        ),
    )
    ladder = [(shape, config_of(shape)) for shape in (small, middle, large)]

    def gflops_for(steps: int, shape: Shape) -> float:
        """The rate at which 240 s buys `shape` exactly `steps` steps (a hair above, against rounding)."""
        [config] = [c for s, c in ladder if s is shape]
        flops = train_step_flops(config.model, config.training.batch_size)
        return steps / (240.0 * STEP_EFFICIENCY * 1e9) * flops * (1 + 1e-9)

    # middle just reaches its 100 steps, large does not: middle, and the reason says what large lacks.
    choice = choose_shape(ladder, 240.0, gflops_for(100, middle), "mocked")
    assert choice.shape is middle and choice.steps["middle"] == 100 and choice.steps["large"] < 100
    assert f"large would get {choice.steps['large']:,}, short of the 100 it needs" in choice.reason
    # One step short of it: the smallest.
    assert choose_shape(ladder, 240.0, gflops_for(99, middle), "mocked").shape is small
    # Enough for the largest: it, and no rung above it to name.
    choice = choose_shape(ladder, 240.0, gflops_for(100, large), "mocked")
    assert choice.shape is large and "short of" not in choice.reason
    # A budget twice as long buys twice the steps.
    assert choose_shape(ladder, 480.0, gflops_for(50, large), "mocked").shape is large


def test_the_quickstart_sizes_the_fast_recipe_to_the_device(tmp_path, mocked_device, capsys) -> None:
    """A CPU that multiplies slowly gets the smallest shape; one with fast bf16 matmuls the largest (more
    sequences a step), for the same budget. The choice is printed with its reason, written to shape.json, and a run that already started
    keeps its shape when the machine now measures otherwise."""
    run = RunDirectory(tmp_path / "run")
    record = tmp_path / "shape.json"
    mocked_device(cpu("slow CPU", fp32=20.0))
    slow = choose_fast_shape(FULL, DATA, run, 240.0, "cpu", record)
    assert slow is FAST_SHAPES[0]
    written = json.loads(record.read_text())
    assert written["shape"] == slow.name and "fp32 matmuls at 20.0 GFLOP/s" in written["reason"]
    assert f"shape: {written['reason']}" in " ".join(capsys.readouterr().err.split())

    mocked_device(cpu("fast CPU", fp32=100.0, bf16=5000.0))
    fast = choose_fast_shape(FULL, DATA, run, 240.0, "cpu", record)
    assert fast is FAST_SHAPES[-1] and "bf16 matmuls at 5,000.0" in json.loads(record.read_text())["reason"]
    assert config_of(fast).training.batch_size > config_of(slow).training.batch_size

    # The run started with the small shape; resumed on the fast machine, it keeps it.
    run.path.mkdir()
    run.config.write_text(train_config(FULL, DATA, run.path, 240.0, "cpu", 0, "fast", slow).to_toml())
    assert choose_fast_shape(FULL, DATA, run, 240.0, "cpu", record) is slow
    assert "as the run in" in json.loads(record.read_text())["reason"]
