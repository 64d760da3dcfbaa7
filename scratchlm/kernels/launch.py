"""Launch settings for the attention kernels that fit the GPU they run on.

A kernel's shared memory is fixed when Triton compiles it: the tiles its dots read, times the pipeline's
stages, in a layout that depends on the architecture (mma on sm_80/86/89, wgmma on sm_90, FMA below sm_80,
where Triton has no tensor-core dots) and on the dtype. A launch that asks for more than the GPU's per-block
maximum fails, so a fixed block size either wastes a large GPU or crashes a small one. Each kernel therefore
has, per padded head size, a ladder of settings from the fastest on an H100 or A100 down to the small ones
(`BLOCK_M = BLOCK_N = 32`, 4 warps, 1 stage, then 16 × 16); the first whose compiled kernel fits the device's
limit is used. Where none does, the model runs `causal_attention` instead (`scratchlm.kernels.dispatch`).

The check compiles ahead of time for the device's architecture (`triton.compile` with an explicit
`GPUTarget`), which needs no GPU: the same function picks the settings at run time and draws the table of
every architecture on a machine without one (`scratchlm.kernels.aot`, `benchmarks/bench_gpu.py --aot`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from scratchlm.errors import ScratchlmError
from scratchlm.kernels.flash_kernels import KERNELS

#: The per-block shared-memory maximum (opt-in) by compute capability, from CUDA's programming guide: V100,
#: T4, A100 (and Orin), the GA10x/AD10x parts (A10, RTX 30/40, L4, L40), H100/H200. At run time the device's
#: own figure is used; this table serves the ahead-of-time check.
SHARED_MEMORY_LIMIT = {
    70: 98_304,
    75: 65_536,
    80: 166_912,
    86: 101_376,
    87: 166_912,
    89: 101_376,
    90: 232_448,
}
ARCHITECTURES = {70: "V100", 75: "T4", 80: "A100", 86: "A10/RTX 30", 89: "L4/RTX 40", 90: "H100"}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: Pointer arguments that hold float32 whatever the inputs' dtype: the softmax statistics and the partial
#: results of split decoding.
FLOAT32_POINTERS = {"LSE", "DELTA", "PARTIAL_OUT", "PARTIAL_LSE"}


@dataclass(frozen=True)
class Settings:
    """Block sizes and launch options. `block_n` is unused by the combine kernel (it merges whole rows).
    `min_arch`: the settings suit tensor-core dots (bf16/fp16) from this compute capability on, and are not
    tried elsewhere; 0 means anywhere."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_arch: int = 0

    def applies(self, arch: int, dtype: torch.dtype) -> bool:
        return self.min_arch == 0 or (arch >= self.min_arch and dtype in (torch.bfloat16, torch.float16))

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


#: The settings every ladder ends with: 32 × 32 blocks, 4 warps, no pipelining, which every GPU since sm_70
#: has room for at 16-bit head sizes up to 128, then 16 × 16 for the largest tiles.
SMALL, SMALLEST = Settings(32, 32, 4, 1), Settings(16, 16, 4, 1)
#: Under Triton's interpreter, which has no shared memory to run out of: blocks small enough that the tests'
#: short sequences span several, large enough that the interpreter is not slowed down by their number.
INTERPRETER_SETTINGS = SMALL


def _ladder(*entries: tuple[int, ...]) -> tuple[Settings, ...]:
    """Settings from the preferred down to the smallest."""
    return (*(Settings(*e) for e in entries), SMALL, SMALLEST)


#: Per kernel and padded head size, the settings to try in order. The tensor-core entries (`min_arch` 80 or
#: 90) are block shapes whose kernels spill no registers on sm_80, sm_86/89 and sm_90, largest first (`python
#: benchmarks/bench_gpu.py --aot` shows them; untuned for speed, which needs a GPU); the rest, for FMA dots
#: (below sm_80, or float32), trade block size and pipeline depth for shared memory.
_SMALL_HEADS_FORWARD = _ladder((128, 128, 8, 3, 90), (128, 64, 4, 3, 80), (64, 64, 4, 2))
_SMALL_HEADS_DECODE = _ladder((16, 128, 4, 3, 80), (16, 64, 4, 2))
_SMALL_HEADS_KV = _ladder((32, 128, 8, 3, 80), (32, 64, 4, 2))
_SMALL_HEADS_Q = _ladder((128, 32, 8, 3, 80), (64, 32, 4, 2))
LADDERS: dict[str, dict[int, tuple[Settings, ...]]] = {
    "forward": {
        **dict.fromkeys((16, 32, 64), _SMALL_HEADS_FORWARD),
        128: _ladder((128, 64, 8, 3, 90), (64, 64, 4, 3, 80), (64, 32, 4, 2)),
        256: _ladder((64, 64, 8, 2, 80), (64, 32, 8, 2, 80)),
    },
    "decode": {
        **dict.fromkeys((16, 32, 64), _SMALL_HEADS_DECODE),
        128: _ladder((16, 128, 4, 3, 80), (16, 64, 4, 3, 80), (16, 64, 4, 2)),
        256: _ladder((16, 64, 8, 3, 80), (16, 64, 8, 2, 80), (16, 32, 4, 2)),
    },
    "combine": dict.fromkeys((16, 32, 64, 128, 256), (Settings(16, 0, 4, 1),)),
    "backward_kv": {
        **dict.fromkeys((16, 32, 64), _SMALL_HEADS_KV),
        128: _ladder((16, 128, 8, 2, 80), (16, 64, 8, 2, 80)),
        256: _ladder((16, 32, 8, 2, 80)),
    },
    "backward_q": {
        **dict.fromkeys((16, 32, 64), _SMALL_HEADS_Q),
        128: _ladder((128, 32, 8, 3, 90), (128, 32, 8, 2, 80), (64, 32, 4, 2)),
        256: _ladder((64, 32, 8, 3, 90), (64, 32, 8, 2, 80), (32, 32, 4, 2, 80)),
    },
}


def padded(head_dim: int) -> int:
    """The head size the kernels compute with: the next power of two, at least 16 (`tl.dot`'s minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def constexprs(kind: str, settings: Settings, head_dim: int, causal: bool, interpreted: bool,
               dtype: torch.dtype) -> dict[str, object]:  # fmt: skip
    """The compile-time arguments of `kind`'s kernel: block sizes, head size, masks and the dot's precision
    (`FP32_DOTS` under the interpreter, full float32 products for float32 inputs)."""
    values = {
        "CAUSAL": causal,
        "BLOCK_M": settings.block_m,
        "BLOCK_N": settings.block_n,
        "HEAD_DIM": head_dim,
        "D_PAD": padded(head_dim),
        "FP32_DOTS": interpreted,
        "IEEE": dtype == torch.float32,
    }
    return {name: value for name, value in values.items() if name in KERNELS[kind].arg_names}


def compile_for(kind: str, settings: Settings, arch: int, dtype: torch.dtype, head_dim: int,
                causal: bool = True) -> triton.compiler.CompiledKernel:  # fmt: skip
    """`kind`'s kernel compiled for NVIDIA compute capability `arch` (80 for sm_80), no GPU needed. The
    arguments are typed as Triton types them at a launch with realistic tensors: 16-byte-aligned pointers,
    32-bit sizes, strides that are multiples of 16 (any head size the kernels serve fast)."""
    fn = KERNELS[kind]
    constants = constexprs(kind, settings, head_dim, causal, False, dtype)
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.isupper():  # a tensor
            signature[name] = "*fp32" if name in FLOAT32_POINTERS else f"*{DTYPES[dtype]}"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.startswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn, signature, constants, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": settings.num_warps, "num_stages": settings.num_stages},
    )


@functools.cache
def choose(
    kind: str, arch: int, limit: int, dtype: torch.dtype, head_dim: int, causal: bool
) -> Settings | None:
    """The first settings of `kind`'s ladder that apply to `arch` and `dtype` and whose kernel, compiled for
    `arch`, fits `limit` bytes of shared memory; None when none does."""
    for settings in LADDERS[kind][padded(head_dim)]:
        if (
            settings.applies(arch, dtype)
            and compile_for(kind, settings, arch, dtype, head_dim, causal).metadata.shared <= limit
        ):
            return settings
    return None


def device_limits(device: torch.device) -> tuple[int, int]:
    """The compute capability (e.g. 90) of a CUDA device and the shared memory one block may use there, as
    Triton's launcher checks it."""
    arch, limit, _ = _properties(_index(device))
    return arch, limit


def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device."""
    return _properties(_index(device))[2]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int) -> tuple[int, int, int]:
    """Compute capability, per-block shared memory and multiprocessors of CUDA device `index`, asked once:
    Triton's query takes about a millisecond (measured on an H200), which every launch would otherwise pay:
    three times an attention forward and backward, 4 ms where the kernels take 0.3."""
    major, minor = torch.cuda.get_device_capability(index)
    properties = triton.runtime.driver.active.utils.get_device_properties(index)
    return major * 10 + minor, properties["max_shared_mem"], properties["multiprocessor_count"]


def settings_for(
    kind: str, device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool
) -> Settings:
    """The settings to launch `kind`'s kernel with on `device` (off a GPU: the interpreter's)."""
    if device.type != "cuda":
        return LADDERS[kind][padded(head_dim)][-1] if kind == "combine" else INTERPRETER_SETTINGS
    arch, limit = device_limits(device)
    settings = choose(kind, arch, limit, dtype, head_dim, causal)
    if settings is None:
        raise ScratchlmError(
            f"no launch setting of the attention kernel {kind!r} fits the {limit:,} B of shared memory of "
            f"{torch.cuda.get_device_name(device)} (sm_{arch}) for {dtype} d_head {head_dim}"
        )
    return settings


def fits(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool = True) -> bool:
    """Whether every attention kernel (forward, decode, backward) has settings that fit `device`."""
    if device.type != "cuda":
        return True
    arch, limit = device_limits(device)
    return all(choose(kind, arch, limit, dtype, head_dim, causal) is not None for kind in KERNELS)
