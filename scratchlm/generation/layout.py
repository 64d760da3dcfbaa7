"""A model laid out for inference as the device plan says: the one place where the plan touches a model.

    prepare_for_inference(model, plan)   every command that runs a trained model calls this once, after
                                         loading it and before generating, evaluating or serving
    prepare_for_inference(model, plan, quantize="int8")
                                         the same, the matrices held as int8 (`--quantize int8`;
                                         `scratchlm.generation.quantize`)

The plan (`scratchlm.device.Plan`) holds the facts and the choices of the machine and never touches a model
(the device package sits below the model); this module, above both, applies them. Weights are held in the
compute dtype rather than cast from float32 at every matmul: decoding a token reads every weight once, so its
speed is bound by memory bandwidth, and bf16 weights halve the bytes read. The model's own
float32 islands (RMSNorm, softmax, the loss, sampling) stay float32, and so do the buffers: RoPE's cosines and
sines keep float32, and each rotation is rounded once.

On a CPU the process also keeps the memory of freed large blocks (`scratchlm.allocator`): a decode step
allocates and frees the same buffers every token (16 rows of logits are 640 KB), and glibc's malloc may serve
each from a fresh `mmap` whose pages the kernel zeroes again. Measured on a 2-core Zen 3: the softmax of 16
rows of 10,000 logits took 1.8-2.5 ms in some processes and 0.3 ms in others, and 0.3 ms in every process
with the memory kept.
"""

from __future__ import annotations

import torch
from torch import nn

from scratchlm.allocator import keep_freed_memory
from scratchlm.device.planning import Plan
from scratchlm.generation.quantize import check_scheme, quantize_weights
from scratchlm.model.layers import lay_out_for_inference
from scratchlm.model.transformer import TransformerLM


def prepare_for_inference(model: nn.Module, plan: Plan, quantize: str | None = None) -> nn.Module:
    """`model` in eval mode with its parameters held in `plan.dtype`, the matrices that read the same input
    stacked into one (`LinearStack`), `plan.matvec`'s way applied, and compiled decode steps allowed as
    `plan.decode` says (`scratchlm.generation.decode`), in place; returned for chaining. With `quantize`
    ("int8"), the matrices are held in it (`quantize_weights`), quantized from the weights as loaded, before
    the cast, and multiplied eagerly the way `plan.int8_matmul` says. On a CPU, freed memory is kept for the
    next step from then on."""
    check_scheme(quantize)
    if torch.device(plan.device).type == "cpu":
        keep_freed_memory()
    model.eval()
    if quantize is not None:
        quantize_weights(model, quantize, plan.dtype)
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != plan.dtype:
            parameter.data = parameter.data.to(plan.dtype)
    lay_out_for_inference(
        model,
        wide_by_columns=plan.matvec.value == "columns",
        int8_form=plan.int8_matmul.value,
    )
    if isinstance(model, TransformerLM):
        model.one_token_without_onednn = plan.matvec.value == "rows_no_onednn"
        model.compiled_decode = bool(plan.decode.value)
    return model
