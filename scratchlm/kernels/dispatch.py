"""Which attention `model.attention` runs on a given device: the Triton kernel or `causal_attention`.

The kernel is faster only where Triton compiles its dots to tensor cores: compute capability 8.0 (Ampere) and
up, with bfloat16 or float16 inputs. Below sm_80 Triton lowers `tl.dot` to FMA instructions, and float32
inputs take full-precision float32 products (as `torch.matmul` does by default), which no tensor core
computes; there the blocked tensor implementation runs on cuBLAS and is the better choice. So `"auto"` takes
the kernel only on sm_80+ with bf16/fp16; an explicit `"triton"` is obeyed anywhere, with a one-line warning
where it is expected to be slow. Either way, a (device, dtype, head size) that no launch setting fits in
shared memory runs `causal_attention`, with a one-line notice, rather than failing at launch.

The answer depends only on the arguments (and the device), so it is computed once per combination (and each
notice printed once) and `torch.compile` takes it as a constant instead of tracing the compilation it may do.
"""

from __future__ import annotations

import torch

from scratchlm.console import console
from scratchlm.kernels.flash import MAX_HEAD_DIM, MIN_HEAD_DIM
from scratchlm.kernels.launch import fits

TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)
#: The decisions made so far, by `uses_kernel`'s arguments. (Not `functools.cache`: torch.compile sees through
#: it and would trace the decision.)
DECIDED: dict[tuple[str, torch.device, torch.dtype, int], bool] = {}


def fast_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel's dots run on tensor cores: a CUDA device of compute capability 8.0+, bf16/fp16."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and dtype in TENSOR_CORE_DTYPES
    )


@torch.compiler.assume_constant_result
def uses_kernel(attention: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `model.attention` ("auto" or "triton") runs the Triton kernel for queries of `dtype` and
    `head_dim` on `device`. Off a CUDA device "triton" is kept (Triton's interpreter, or flash_attention's
    clear error) and "auto" is not."""
    key = (attention, device, dtype, head_dim)
    if key not in DECIDED:
        DECIDED[key] = _decide(*key)
    return DECIDED[key]


def _decide(attention: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if device.type != "cuda":
        return attention == "triton"
    supported = MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM
    fast = fast_on(device, dtype)
    if attention == "auto" and not (fast and supported):
        return False
    if not supported:  # "triton" with a head size the kernel lacks: flash_attention says so
        return True
    major, minor = torch.cuda.get_device_capability(device)
    where = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    if not fits(device, dtype, head_dim):
        console.print(
            f"warning: no launch setting of the Triton attention kernel fits {dtype} d_head {head_dim} in "
            f"the shared memory of {where}; attention runs in causal_attention",
            style="yellow",
        )
        return False
    if not fast:
        console.print(
            f'warning: model.attention = "triton" is slow on {where} with {dtype}: Triton uses tensor cores '
            f'only from sm_80 with bf16 or fp16 ("auto" would run causal_attention)',
            style="yellow",
        )
    return True
