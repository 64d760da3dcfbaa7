"""On a CUDA device (marker `gpu`; skipped elsewhere), the compiled kernels: against float64 over dtypes, head
sizes (padded and not), causal or not, decoding to training shapes and grouped-query attention; a backward
that is bit-identical run to run; grids past CUDA's 65,535 programs on the second axis; tensors on a device
that is not the current one; and kernels from Triton's JIT that ask for the shared memory the launch
settings were chosen with."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from test_flash_attention import check_against_reference

from scratchlm.kernels import flash_attention
from scratchlm.kernels.flash_kernels import KERNELS
from scratchlm.kernels.launch import compile_for, device_limits, settings_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_head", [16, 24, 64, 80, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k", [(1, 4097), (17, 100), (1000, 1000)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_against_float64(dtype, d_head, causal, seq_q, seq_k, heads, kv_heads):
    check_against_reference(2, heads, kv_heads, seq_q, seq_k, d_head, causal, dtype)


def test_the_backward_is_bit_identical_run_to_run():
    # One program owns each output row (no atomics), so nothing depends on scheduling order.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 333, 80, generator=generator).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 2, 333, 80, generator=generator).to("cuda", torch.bfloat16) for _ in range(2))
    grad = torch.randn(q.shape, generator=generator).to("cuda", torch.bfloat16)

    def run():
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attention(*inputs)
        out.backward(grad)
        return [out, *(x.grad for x in inputs)]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("seq_q", [17, 1])
def test_batch_times_heads_past_the_grids_second_axis_limit(seq_q):
    # 4,375 × 16 = 70,000 programs along batch × heads, in the forward, the decode and both backward kernels.
    check_against_reference(4375, 16, 16, seq_q, 40, 16, True, torch.bfloat16)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="requires two CUDA devices")
def test_tensors_on_a_device_that_is_not_the_current_one():
    with torch.cuda.device(0):
        check_against_reference(1, 4, 2, 100, 100, 64, True, torch.bfloat16, device="cuda:1")
        check_against_reference(1, 4, 2, 3, 100, 64, True, torch.bfloat16, device="cuda:1")


def test_jit_kernels_ask_for_the_shared_memory_they_were_chosen_with():
    # The launch settings are chosen by compiling for the device's architecture with representative argument
    # types; the kernels Triton's JIT builds for real tensors must need the same shared memory.
    device = torch.device("cuda", torch.cuda.current_device())
    for kernel in KERNELS.values():  # only this test's kernels in Triton's cache
        kernel.device_caches.clear()
    check_against_reference(1, 4, 2, 100, 100, 128, True, torch.bfloat16)
    check_against_reference(1, 4, 2, 3, 100, 128, True, torch.bfloat16)
    arch, limit = device_limits(device)
    for kind, kernel in KERNELS.items():
        chosen = settings_for(kind, device, torch.bfloat16, 128, True)
        expected = compile_for(kind, chosen, arch, torch.bfloat16, 128).metadata.shared
        jitted = kernel.device_caches[device.index][0].values()
        assert jitted and all(k.metadata.shared == expected <= limit for k in jitted), kind
