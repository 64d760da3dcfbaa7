"""The device a command runs on, what it can do, and what scratchlm chooses on it.

    resolve_device   "auto" -> cuda, then mps, then cpu; or the device a name gives   (select.py)
    device_profile   the device's capabilities and measured rates, cached per machine  (profile.py)
    plan             precision, threads and compilation for that device, each with its reason  (choices.py)

`scratchlm doctor` prints all of it; `scratchlm train` and the quickstart print the plan's one line when they
start, and record it in the run.
"""

from scratchlm.device.choices import PRECISIONS, Plan, apply_threads, autocast, plan, resolve_precision
from scratchlm.device.profile import DeviceProfile, device_profile, usable_cores
from scratchlm.device.select import resolve_device

__all__ = [
    "PRECISIONS",
    "DeviceProfile",
    "Plan",
    "apply_threads",
    "autocast",
    "device_profile",
    "plan",
    "resolve_device",
    "resolve_precision",
    "usable_cores",
]
