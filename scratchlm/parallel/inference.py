"""A model laid out for inference as the device plan says: the one place where the plan touches a model.

The plan (`scratchlm.device.Plan`) holds the facts and the choices of the machine; this applies them. Weights
are held in the compute dtype rather than cast from float32 at every matmul: decoding a token reads every
weight once, so its speed is bound by memory bandwidth, and bf16 weights halve the bytes read. The model's own
float32 islands (RMSNorm, softmax, the loss, sampling) stay float32, and so do the buffers: RoPE's cosines and
sines keep float32, and each rotation is rounded once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from scratchlm.model.layers import lay_out_for_inference
from scratchlm.model.transformer import TransformerLM

if TYPE_CHECKING:
    from scratchlm.device.planning import Plan


def prepare_for_inference(model: nn.Module, plan: Plan) -> nn.Module:
    """`model` in eval mode with its parameters held in `plan.dtype`, the matrices that read the same input
    stacked into one (`LinearStack`), `plan.matvec`'s way applied, and compiled decode steps allowed as
    `plan.decode` says (`scratchlm.generation.decode`), in place; returned for chaining."""
    model.eval()
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != plan.dtype:
            parameter.data = parameter.data.to(plan.dtype)
    lay_out_for_inference(model, wide_by_columns=plan.matvec.value == "columns")
    if isinstance(model, TransformerLM):
        model.one_token_without_onednn = plan.matvec.value == "rows_no_onednn"
        model.compiled_decode = bool(plan.decode.value)
    return model
