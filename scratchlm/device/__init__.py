"""The device a command runs on, what it can do, and how scratchlm runs a model on it.

    resolve_device   "auto" -> cuda, then mps, then cpu; or the device a name gives   (select.py)
    device_profile   the device's capabilities and measured rates, cached per machine  (profile.py)
    choices          precision, threads, compilation, the fused loss and the MFU peak, each with its reason
                     (choices.py)
    plan             all of them for one device, and what follows from them: the autocast context, the dtype
                     of inference weights and KV caches, loss scaling   (plan.py)

`scratchlm doctor` prints all of it; every command that runs a model gets its plan from `plan()`, and
`scratchlm train` and the quickstart print its one line when they start and record it in the run.
"""

from scratchlm.device.choices import apply_threads, resolve_precision
from scratchlm.device.planning import Plan, plan
from scratchlm.device.profile import DeviceProfile, device_profile, usable_cores
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
