"""The precisions scratchlm knows, in one list: the config's `training.precision` and every command's
`--precision` take one of them; `scratchlm.device.choices` resolves "auto" on the device at hand. (A module
of its own, without torch, so that the command line can list them before torch loads: the dtypes are named.)"""

from typing import Literal, get_args

Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
#: The torch dtype each precision but "auto" computes in; the device profile measures each one's matmul rate.
DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
