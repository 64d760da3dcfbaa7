"""The fast recipe's shape for the steps a budget buys: the count by hand from a step's timing, the ladder's
choice at its edges, the step timed by the run itself (and measured once per machine), and the quickstart's
choice with the device mocked both ways (a slow fp32 CPU, a fast bf16 one), recorded in the run and kept when
the run resumes on a machine that measures otherwise."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.data.prepare import PreparedData
from scratchlm.device import plan, planning
from scratchlm.device.profile import DeviceProfile
from scratchlm.quickstart import FAST_SHAPES, FULL, SMALL, choose_fast_shape, train_config
from scratchlm.run import RunDirectory
from scratchlm.training import sizing
from scratchlm.training.config import TrainConfig
from scratchlm.training.sizing import Shape, StepTiming, choose_shape, measure_step, predicted_steps

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


@pytest.fixture
def timed_steps(monkeypatch):
    """`measure_step` mocked: a step of `seconds[batch]`, after a start-up of 10 s."""

    def use(seconds: dict[int, float]) -> None:
        def measured(config, choices):
            return StepTiming(startup_s=10.0, step_s=seconds[config.training.batch_size])

        monkeypatch.setattr(sizing, "measure_step", measured)

    return use


def test_the_steps_a_budget_buys_by_hand() -> None:
    # The smallest shape evaluates 5 batches of 8 sequences forward every 50 steps of 8: a forward pass is a
    # third of a step, so evaluations add 5 / 3 / 50 = 1/30 to each step. 20 steps are taken before the
    # budget decides, the first ending 10 s in: 10 + 19 × 0.1 = 11.9 s. Of the 48.1 s left of a minute, 92 % is
    # planned for steps of 0.1 × 31/30 s: 428.25 of them, 448 in all.
    smallest = config_of(FAST_SHAPES[0])
    assert predicted_steps(smallest, 60.0, StepTiming(10.0, 0.1)) == 448
    # Two minutes: 20 + int(0.92 × 108.1 / (0.1 × 31/30)) = 20 + 962.
    assert predicted_steps(smallest, 120.0, StepTiming(10.0, 0.1)) == 982
    # A budget shorter than the start-up buys only the steps that decide.
    assert predicted_steps(smallest, 5.0, StepTiming(10.0, 0.1)) == 20


def test_the_ladder_takes_the_largest_shape_that_gets_the_steps_it_needs(timed_steps) -> None:
    small, middle, large = (
        Shape("small", {"training": {"batch_size": 8}}),
        Shape("middle", {"training": {"batch_size": 16}}, min_steps=100),
        Shape("large", {"training": {"batch_size": 32}}, min_steps=100),
    )
    ladder = [(shape, config_of(shape)) for shape in (small, middle, large)]
    choices = plan(torch.device("cpu"), "fp32")
    # Evaluations add 1/30 of a step whatever the batch (the evaluation batch is the training batch): 100
    # steps in 240 s need 20 + int(0.92 × (240 - 10 - 19 s) / (s × 31/30)) >= 100, s <= 2.1129 s.
    timed_steps({8: 0.5, 16: 2.11, 32: 2.12})
    choice = choose_shape(ladder, 240.0, choices, "mocked")
    assert choice.shape is middle and choice.steps["middle"] == 100 and choice.steps["large"] == 99
    assert "large would get 99, short of the 100 it needs" in choice.reason
    assert "steps of 2.110 s" in choice.reason and choice.timings["middle"] == StepTiming(10.0, 2.11)
    # A slower middle step: the smallest.
    timed_steps({8: 0.5, 16: 2.12, 32: 2.12})
    assert choose_shape(ladder, 240.0, choices, "mocked").shape is small
    # Enough for the largest: it, and no rung above it to name.
    timed_steps({8: 0.5, 16: 1.0, 32: 2.0})
    choice = choose_shape(ladder, 240.0, choices, "mocked")
    assert choice.shape is large and "short of" not in choice.reason
    # A budget twice as long buys about twice the steps.
    assert choose_shape(ladder, 480.0, choices, "mocked").steps["large"] > 2 * choice.steps["large"] - 25


def test_a_step_is_timed_by_the_run_itself_once_per_machine(tmp_path, monkeypatch) -> None:
    """The probe trains `PROBE_STEPS` steps of the config in a scratch directory: its timing is the metrics'
    clock (the first step apart), it leaves no run behind, and a second call reads the record instead."""
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))
    tokens = np.tile(np.arange(SMALL.vocab_size, dtype=np.uint16), 40)
    np.save(tmp_path / "train.npy", tokens)
    np.save(tmp_path / "valid.npy", tokens[:2000])
    data = PreparedData(tmp_path, tmp_path / "train.npy", tmp_path / "valid.npy")
    values = train_config(SMALL, data, tmp_path / "run", 60.0, "cpu", 0, "fast", FAST_SHAPES[0]).to_dict()
    values["data"]["tokenizer"] = ""  # token ids made here, by no tokenizer
    values["training"]["precision"] = "fp32"  # not what "auto" resolves to on this machine
    config = TrainConfig.from_dict(values)
    choices = plan(torch.device("cpu"), config.training.precision, compile=False)
    timing = measure_step(config, choices)
    assert 0 < timing.step_s < timing.startup_s + timing.step_s and timing.startup_s > 0
    assert not (tmp_path / "run").exists()  # the probe trained elsewhere
    record = json.loads((tmp_path / "cache" / "train-timings.json").read_text())
    [(key, values)] = record.items()
    assert values == {"startup_s": timing.startup_s, "step_s": timing.step_s}
    assert f"batch={config.training.batch_size}" in key and "compile=False" in key
    monkeypatch.setattr("scratchlm.training.trainer.train", lambda *a, **k: pytest.fail("timed again"))
    assert measure_step(config, choices) == timing


def test_the_quickstart_sizes_the_fast_recipe_to_the_device(
    tmp_path, mocked_device, monkeypatch, capsys
) -> None:
    """A CPU without native bf16 trains in fp32 and gets the smallest shape; one with it, in bf16 with faster
    steps, the largest (more sequences a step), for the same budget: the steps are timed in the precision the
    plan chooses. The choice is printed with its reason and the timings, written to shape.json, and a run
    that already started keeps its shape when the machine now measures otherwise."""
    # A step, by precision and batch, compiled; eager steps take twice as long (the same ratio between shapes).
    seconds = {"fp32": {8: 0.8, 16: 1.5}, "bf16": {8: 0.2, 16: 0.35}}
    timed = []
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))

    def measured(config, choices):
        timed.append(choices.precision.value)
        slower = 1 if choices.compile.value else 2
        return StepTiming(10.0, slower * seconds[choices.precision.value][config.training.batch_size])

    monkeypatch.setattr(sizing, "measure_step", measured)
    run = RunDirectory(tmp_path / "run")
    record = tmp_path / "shape.json"
    mocked_device(cpu("slow CPU", fp32=20.0))
    slow = choose_fast_shape(FULL, DATA, run, 240.0, "cpu", record)
    assert slow is FAST_SHAPES[0] and set(timed) == {"fp32"}
    written = json.loads(record.read_text())
    assert written["shape"] == slow.name and "fp32" in written["reason"]
    assert written["timings"][slow.name] == {"startup_s": 10.0, "step_s": 0.8}
    # 16 sequences at 1.5 s a step: 20 + int(0.92 × (240 - 10 - 28.5) / (1.5 × 31/30)) = 139 < 300.
    # 8 sequences at 0.8 s: 20 + int(0.92 × (240 - 10 - 15.2) / (0.8 × 31/30)) = 20 + 239.
    assert written["steps"] == {FAST_SHAPES[0].name: 259, FAST_SHAPES[1].name: 139}
    assert f"shape: {written['reason']}" in " ".join(capsys.readouterr().err.split())

    mocked_device(cpu("fast CPU", fp32=100.0, bf16=5000.0))
    fast = choose_fast_shape(FULL, DATA, run, 240.0, "cpu", record)
    assert fast is FAST_SHAPES[-1] and "bf16" in json.loads(record.read_text())["reason"]
    assert set(timed[timed.index("bf16") :]) == {"bf16"}
    assert config_of(fast).training.batch_size > config_of(slow).training.batch_size

    # The run started with the small shape; resumed on the fast machine, it keeps it, timing nothing.
    run.path.mkdir()
    run.config.write_text(train_config(FULL, DATA, run.path, 240.0, "cpu", 0, "fast", slow).to_toml())
    count = len(timed)
    assert choose_fast_shape(FULL, DATA, run, 240.0, "cpu", record) is slow and len(timed) == count
    assert "as the run in" in json.loads(record.read_text())["reason"]


def test_a_compiled_run_is_timed_after_a_step_that_compiled_it(tmp_path, monkeypatch) -> None:
    """The probe of a compiled run trains one step first, untimed, so that the timed steps start as a run
    does after it: with the compiler's caches filled. An eager run needs no such step."""
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))
    trained = []

    def briefly(config, compiled, steps, run_dir):
        trained.append((steps, run_dir.name, compiled))
        return [3.0 + 0.5 * i for i in range(steps)]

    monkeypatch.setattr(sizing, "_train_briefly", briefly)
    config = config_of(FAST_SHAPES[0])
    timing = measure_step(config, plan(torch.device("cpu"), "fp32", compile=True))
    assert trained == [(1, "compile", True), (sizing.PROBE_STEPS, "timed", True)]
    assert timing == StepTiming(startup_s=3.0, step_s=0.5)
    trained.clear()
    measure_step(config, plan(torch.device("cpu"), "fp32", compile=False))
    assert trained == [(sizing.PROBE_STEPS, "timed", False)]


def test_a_budgeted_run_replaces_the_probe_with_what_it_measured(tmp_path, monkeypatch) -> None:
    """At its decision (step 20, 0.5 s a step, 22.5 s spent) a run started up in 22.5 - 19 × 0.5 = 13 s: the
    next prediction for its shape reads that, without timing anything."""
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sizing, "_train_briefly", lambda *a: pytest.fail("timed again"))
    config, choices = config_of(FAST_SHAPES[0]), plan(torch.device("cpu"), "fp32", compile=True)
    sizing.record_run(config, choices, 20, 0.5, 22.5)
    assert measure_step(config, choices) == StepTiming(startup_s=13.0, step_s=0.5)
    assert predicted_steps(config, 120.0, StepTiming(13.0, 0.5)) == 20 + int(0.92 * 97.5 / (0.5 * 31 / 30))


def test_a_compiled_ladder_compiles_only_its_smallest_shape(tmp_path, monkeypatch) -> None:
    """The smallest shape is timed compiled; the larger one eagerly, beside the smallest eagerly, and its
    compiled step is the smallest's scaled by that ratio (0.4 s × 1.8 / 1.0 = 0.72 s), with the smallest's
    start-up. A shape a run has trained keeps its own record instead."""
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))
    runs = []
    steps = {(8, True): 0.4, (8, False): 1.0, (16, False): 1.8}

    def briefly(config, compiled, count, run_dir):
        runs.append((config.training.batch_size, compiled))
        return [5.0 + steps[(config.training.batch_size, compiled)] * i for i in range(count)]

    monkeypatch.setattr(sizing, "_train_briefly", briefly)
    ladder = [(shape, config_of(shape)) for shape in FAST_SHAPES]
    compiled = plan(torch.device("cpu"), "fp32", compile=True)
    timed = sizing.ladder_timings(ladder, compiled)
    small, large = (shape.name for shape in FAST_SHAPES)
    assert timed[small] == StepTiming(5.0, 0.4) and timed[large] == StepTiming(5.0, 0.72)
    assert (16, True) not in runs  # never compiled
    sizing.record_run(ladder[1][1], compiled, 20, 0.6, 20.0)
    assert sizing.ladder_timings(ladder, compiled)[large] == StepTiming(startup_s=8.6, step_s=0.6)


def test_a_timing_is_keyed_by_the_runs_threads_not_the_processs() -> None:
    """A run sets its threads as it starts, so the record it leaves must be found by a process that has not."""
    from helpers import torch_threads

    config, choices = config_of(FAST_SHAPES[0]), plan(torch.device("cpu"), "fp32", threads=1)
    with torch_threads(1):
        before = sizing.timing_key(config, choices)
    with torch_threads(2):
        assert sizing.timing_key(config, choices) == before
