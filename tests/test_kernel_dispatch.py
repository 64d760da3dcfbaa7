"""`model.attention` on GPUs this machine does not have: the compute capability, the device's name and
whether the kernels fit are mocked, and queries are fake tensors on a CUDA device. "auto" takes the Triton
kernel only on sm_80+ with bf16/fp16; "triton" is obeyed, with a warning where it is slow; a GPU no launch
setting fits runs causal_attention with a notice. Each notice is one line, printed once."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

pytest.importorskip("triton", reason="triton is not installed")

import scratchlm.kernels.dispatch as dispatch
from scratchlm import ModelConfig, TransformerLM

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """`gpu(capability, fits=True)` makes dispatch see a CUDA device of that compute capability."""
    monkeypatch.setattr(dispatch, "DECIDED", {})

    def pretend(capability: tuple[int, int], fits: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        monkeypatch.setattr(dispatch, "fits", lambda device, dtype, head_dim: fits)
        dispatch.DECIDED.clear()

    return pretend


def fake_cuda_queries(dtype: torch.dtype, head_dim: int = 16) -> torch.Tensor:
    """(batch, heads, seq, d) queries that report a CUDA device, without one."""
    meta = torch.empty(1, 4, 3, head_dim, dtype=dtype, device="meta")
    return FakeTensor(FakeTensorMode(), meta, CUDA)


def attention(choice: str):
    config = ModelConfig(
        vocab_size=61, context_length=8, d_model=64, num_layers=1, num_heads=4, attention=choice
    )
    return TransformerLM.from_config(config).layers[0].attn


@pytest.mark.parametrize(
    "capability, dtype, expected",
    [
        ((7, 0), FP16, False),  # V100: Triton has no tensor-core dots there
        ((7, 5), FP16, False),  # T4
        ((7, 5), BF16, False),
        ((8, 0), FP32, False),  # float32 products run on FMA units everywhere
        ((9, 0), FP32, False),
        ((8, 0), BF16, True),
        ((8, 6), FP16, True),
        ((8, 9), BF16, True),
        ((9, 0), BF16, True),
        ((12, 0), FP16, True),
    ],
)
def test_auto_takes_the_kernel_only_from_ampere_on_with_16_bit_floats(
    gpu, capsys, capability, dtype, expected
):
    gpu(capability)
    queries = fake_cuda_queries(dtype)
    assert queries.is_cuda
    assert attention("auto")._uses_kernel(queries) is expected
    assert capsys.readouterr().err == ""  # auto chooses silently


@pytest.mark.parametrize(
    "capability, dtype", [((7, 0), BF16), ((7, 5), FP16), ((8, 0), FP32), ((9, 0), FP32)]
)
def test_triton_is_obeyed_with_one_warning_where_it_is_slow(gpu, capsys, capability, dtype):
    gpu(capability)
    model = attention("triton")
    assert model._uses_kernel(fake_cuda_queries(dtype))
    assert model._uses_kernel(fake_cuda_queries(dtype))
    lines = capsys.readouterr().err.splitlines()
    arch = f"sm_{capability[0]}{capability[1]}"
    assert len(lines) == 1 and f'"triton" is slow on Fake GPU ({arch}) with {dtype}' in lines[0], lines


def test_triton_where_it_is_fast_says_nothing(gpu, capsys):
    gpu((9, 0))
    assert attention("triton")._uses_kernel(fake_cuda_queries(BF16))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("choice", ["auto", "triton"])
def test_a_gpu_no_launch_setting_fits_runs_causal_attention_with_one_notice(gpu, capsys, choice):
    gpu((8, 6), fits=False)
    model = attention(choice)
    assert not model._uses_kernel(fake_cuda_queries(BF16, 128))
    assert not model._uses_kernel(fake_cuda_queries(BF16, 128))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "no launch setting of the Triton attention kernel fits torch.bfloat16 d_head 128" in lines[0]
    assert "Fake GPU (sm_86); attention runs in causal_attention" in lines[0]


def test_head_sizes_the_kernel_lacks(gpu):
    gpu((9, 0))
    assert not dispatch.uses_kernel("auto", CUDA, BF16, 8)
    assert not dispatch.uses_kernel("auto", CUDA, BF16, 512)
    assert dispatch.uses_kernel("auto", CUDA, BF16, 256)
    # An explicit choice is kept, so that flash_attention names the problem rather than a silent fallback.
    assert dispatch.uses_kernel("triton", CUDA, BF16, 8)


def test_off_a_gpu_auto_never_and_triton_always(monkeypatch):
    monkeypatch.setattr(dispatch, "DECIDED", {})

    def no_gpu(*args):
        raise AssertionError("no CUDA call off a GPU")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    for dtype in (BF16, FP32):
        assert not attention("auto")._uses_kernel(torch.zeros(1, 4, 3, 16, dtype=dtype))
        assert attention("triton")._uses_kernel(torch.zeros(1, 4, 3, 16, dtype=dtype))
    assert not attention("torch")._uses_kernel(fake_cuda_queries(BF16))


def test_the_decision_is_made_once_per_device_dtype_and_head_size(gpu, monkeypatch):
    gpu((8, 0))
    calls = []
    monkeypatch.setattr(dispatch, "fits", lambda *args: calls.append(args) or True)
    for _ in range(3):
        assert dispatch.uses_kernel("auto", CUDA, BF16, 64)
    assert dispatch.uses_kernel("auto", CUDA, FP16, 64)
    assert calls == [(CUDA, BF16, 64), (CUDA, FP16, 64)]


def test_compiled_code_takes_the_decision_as_a_constant(gpu, capsys):
    # torch.compile(fullgraph=True) must not trace the decision: it may compile kernels and print a notice,
    # which would break the graph. It is run once, eagerly, and its answer used as a constant.
    gpu((7, 5))

    def forward(x):
        return x * 2 if dispatch.uses_kernel("triton", CUDA, FP16, 64) else x + 1

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert '"triton" is slow on Fake GPU (sm_75)' in capsys.readouterr().err
