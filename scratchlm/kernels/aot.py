"""The attention kernels compiled ahead of time for every NVIDIA architecture they may meet, on any machine.

For each (kernel, architecture, dtype, padded head size) this runs the run-time choice itself
(`launch.choose` against the architecture's shared-memory limit) and reports what the chosen kernel costs:
its shared memory against the limit, and from Triton's own `ptxas` (`-v`) its registers and spilled bytes,
and from the SASS (`cuobjdump -sass`) its instruction mix. `tt.trans` counts the transposes left in registers
(Triton's GPU IR) — tiles the kernels mean to use transposed are read that way from memory.

No GPU is involved: `triton.compile` with an explicit target needs only the compiler that ships with Triton.
Triton's interpreter replaces the kernels with Python, so this runs in a process without `TRITON_INTERPRET`.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
from triton import knobs
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

from scratchlm.errors import ScratchlmError
from scratchlm.kernels.flash_kernels import INTERPRETED, KERNELS
from scratchlm.kernels.launch import ARCHITECTURES, DTYPES, SHARED_MEMORY_LIMIT, choose, compile_for

HEAD_DIMS = (16, 32, 64, 128, 256)
#: SASS opcodes worth counting: tensor-core dots (HMMA on sm_80/86/89, and on sm_90 for tiles of fewer than 64
#: rows; HGMMA on sm_90), FMA dots, shared-memory traffic (LDGSTS = cp.async, LDSM = ldmatrix), spills
#: (LDL/STL), exponentials (MUFU).
OPCODES = ("HMMA", "HGMMA", "FFMA", "LDGSTS", "LDSM", "LDS", "STS", "LDL", "STL", "MUFU", "BAR")


@dataclass
class Row:
    """One (kernel, architecture, dtype, head size): the settings chosen and what their kernel costs."""

    kernel: str
    arch: int
    dtype: str
    head_dim: int
    settings: str | None  # None: nothing fits; attention would run in causal_attention
    shared: int | None
    limit: int
    registers: int | None = None
    spill_stores: int | None = None  # bytes
    spill_loads: int | None = None
    instructions: int | None = None
    mix: dict[str, int] | None = None  # instructions per opcode of OPCODES
    transposes: int | None = None


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """Registers per thread and spilled bytes (stores, loads) as Triton's `ptxas` reports them for `ptx`,
    with the options Triton compiles it with."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        command = [
            get_ptxas(arch).path,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
        ]
        log = subprocess.run(
            [*command, source.name, "-o", "/dev/null"], capture_output=True, text=True, check=True
        )
    registers = re.search(r"Used (\d+) registers", log.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.stderr)
    if registers is None or spills is None:
        raise ScratchlmError(f"unexpected ptxas output: {log.stderr.strip()}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def instruction_mix(cubin: bytes) -> tuple[int, dict[str, int]] | tuple[None, None]:
    """The number of SASS instructions in `cubin` (`cuobjdump -sass`), and of each of `OPCODES`; None for
    an architecture the bundled disassembler no longer reads (sm_70 since CUDA 13)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as binary:
        binary.write(cubin)
        binary.flush()
        dump = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", binary.name], capture_output=True, text=True
        )
    if dump.returncode:
        return None, None
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", dump.stdout)
    counts = collections.Counter(opcodes)
    return len(opcodes), {op: counts[op] for op in OPCODES if counts[op]}


def measure(kernel: str, arch: int, dtype: torch.dtype, head_dim: int) -> Row:
    """The settings the run-time choice takes for this combination, and their kernel's costs."""
    limit = SHARED_MEMORY_LIMIT[arch]
    settings = choose(kernel, arch, limit, dtype, head_dim, True)
    row = Row(kernel, arch, DTYPES[dtype], head_dim, None if settings is None else str(settings), None, limit)
    if settings is None:
        return row
    compiled = compile_for(kernel, settings, arch, dtype, head_dim)
    row.shared = compiled.metadata.shared
    row.registers, row.spill_stores, row.spill_loads = ptxas_usage(compiled.asm["ptx"], arch)
    row.transposes = len(re.findall(r"= tt\.trans ", compiled.asm["ttgir"]))
    row.instructions, row.mix = instruction_mix(compiled.asm["cubin"])
    return row


def sweep(
    kernels: Iterable[str] = KERNELS,
    archs: Iterable[int] = ARCHITECTURES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    head_dims: Iterable[int] = HEAD_DIMS,
    jobs: int = 1,
) -> list[Row]:
    """`measure` over every combination, in `jobs` processes (compiling is single-threaded)."""
    if INTERPRETED:
        raise ScratchlmError("the ahead-of-time sweep compiles the kernels: run it without TRITON_INTERPRET")
    combos = [(k, a, t, d) for k in kernels for a in archs for t in dtypes for d in head_dims]
    if jobs <= 1:
        return [measure(*combo) for combo in combos]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(measure, *zip(*combos, strict=True)))


def table(rows: list[Row]) -> str:
    """The rows as an aligned text table, and a summary per architecture."""
    header = (
        f"{'kernel':<12}{'arch':>5}{'dtype':>6}{'d':>5}  {'settings':<15}{'shared B':>9}{'limit B':>9}"
        f"{'regs':>6}{'spill B':>12}{'trans':>6}{'insts':>7}  mix"
    )
    lines = [header]
    for r in rows:
        spill = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        mix = " ".join(f"{op}:{n}" for op, n in (r.mix or {}).items())
        lines.append(
            f"{r.kernel:<12}{r.arch:>5}{r.dtype:>6}{r.head_dim:>5}  {r.settings or 'NONE FITS':<15}"
            f"{_or_dash(r.shared):>9}{r.limit:>9}{_or_dash(r.registers):>6}{spill:>12}"
            f"{_or_dash(r.transposes):>6}{_or_dash(r.instructions):>7}  {mix}".rstrip()
        )
    lines.append("")
    for arch in sorted({r.arch for r in rows}):
        of_arch = [r for r in rows if r.arch == arch]
        fitting = [r for r in of_arch if r.shared is not None]
        over = [r for r in fitting if r.shared > r.limit]
        spilling = [r for r in fitting if r.spill_stores]
        largest = max((r.shared for r in fitting), default=0)
        lines.append(
            f"sm_{arch} ({ARCHITECTURES.get(arch, '?')}): {len(of_arch)} combinations, "
            f"{len(of_arch) - len(fitting)} with no fitting settings, {len(over)} over the limit; "
            f"largest shared memory {largest:,} B of {SHARED_MEMORY_LIMIT[arch]:,} B; {len(spilling)} spill"
        )
    return "\n".join(lines)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
