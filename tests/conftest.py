"""Test-wide settings.

The tests run tiny models, in two processes at once under pytest-xdist: one intra-op thread per process is
the fastest, while several threads per process on a 2-core machine mostly wait for each other. The variable
also reaches the processes that tests start (torchrun, the CLI).

Without a CUDA device, Triton's kernels (`scratchlm.kernels`) run under its CPU interpreter. Triton reads
`TRITON_INTERPRET` when a kernel is defined, i.e. when `scratchlm.kernels` is first imported, so it is set
here, before any test module is collected.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the thread setting, which torch reads when it loads)

torch.set_num_threads(1)

# The device profile (scratchlm.device.profile) is measured once and cached per machine; the tests keep their
# cache out of the user's home.
os.environ.setdefault(
    "SCRATCHLM_CACHE_DIR", os.path.join(__import__("tempfile").gettempdir(), "scratchlm-test-cache")
)
# Likewise the copies of an export's modeling code that transformers makes when it loads one with
# `trust_remote_code` (it reads the variable when it is first imported).
os.environ.setdefault(
    "HF_MODULES_CACHE", os.path.join(__import__("tempfile").gettempdir(), "scratchlm-test-hf-modules")
)

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
