"""The device a command runs on, what it can do, and how scratchlm runs a model on it.

    resolve_device   "auto" -> cuda, then mps, then cpu; or the device a name gives   (select.py)
    host facts       the CPU's name and flags, usable cores, free memory, other processes' load   (host.py)
    compiler probes  whether torch.compile can generate code here   (compiler.py)
    measured rates   matmul, bandwidth and matrix-vector rates, taken in trials against other work
                     (rates.py)
    device_profile   the device's capabilities and measured rates, cached per machine  (profile.py)
    choices          precision, threads, compilation, the fused loss and the MFU peak, each with its reason
                     (choices.py)
    plan             all of them for one device, and what follows from them: the autocast context, the dtype
                     of inference weights and KV caches, loss scaling   (planning.py)
    decode timings   what a decode step costs here, eager and compiled, per model shape   (decode_timings.py)

The package holds facts about the machine and the choices made from them, and imports nothing from the model
or above it: what applies a plan to a model is above both (`scratchlm.generation.layout`, `scratchlm.parallel`).

`scratchlm doctor` prints all of it; every command that runs a model gets its plan from `plan()`, and
`scratchlm train` and the quickstart print its one line when they start and record it in the run.
"""

from scratchlm.device.choices import apply_threads, resolve_precision
from scratchlm.device.host import usable_cores
from scratchlm.device.planning import Plan, plan
from scratchlm.device.profile import DeviceProfile, device_profile
from scratchlm.device.select import resolve_device
from scratchlm.precisions import PRECISIONS, Precision

__all__ = [
    "PRECISIONS",
    "DeviceProfile",
    "Plan",
    "Precision",
    "apply_threads",
    "device_profile",
    "plan",
    "resolve_device",
    "resolve_precision",
    "usable_cores",
]
