"""Weight-only int8: the model's matrices held in one byte a weight for inference (`--quantize int8`).

Decoding a token multiplies one row of activations by every weight matrix once, two floating-point operations
a weight read. A CPU does tens of those in the time it reads one float32 from memory, so a small model's decode
step is bound by the bytes of its weights, not by its arithmetic: the fewer bytes a weight, the faster a token.
bf16 halves them where the CPU computes it (an AVX2 CPU has no native bf16, and converting costs more than it
saves); int8 quarters them on any CPU, and converting a byte to a float in registers is cheap next to reading it.

Per-channel symmetric int8. Each output row `j` of a weight matrix `W` (its `(out, in)` layout) gets one scale,
`s_j = max_i |W_ji| / 127`, and each weight becomes the integer `q_ji = round(W_ji / s_j)` in [-127, 127];
`W_ji ≈ q_ji s_j`, with an error of at most `s_j / 2`, 1/254 of the row's largest weight. One scale a row
rather than one a matrix, because rows differ in range (one large weight would otherwise cost every row its
resolution), and because the scale then factors out of each output's dot product, `y_j = s_j Σ_i x_i q_ji`:
the product runs on the integers and is scaled once an output (`scratchlm.model.layers.int8_matmul`).

Only the matrices that are multiplied are quantized: the blocks' attention projections (q, k, v, which may be
held stacked, and the output) and feed-forward matrices, and the LM head. The embedding tables are looked up,
one row a token, so their bytes do not count in a step; the RMSNorm gains are vectors; the KV cache holds
activations, whose errors would add up over the context. They all stay in the plan's precision, as do the
activations: this is weight-only quantization, which changes what is read, not what is computed in.

The model is unchanged: each `Linear` keeps its parameter (holding int8 now) under its state-dict key, beside a
scale buffer that no state dict saves, and the checkpoint on disk is never written. A tied LM head gets its
own int8 copy, the embedding table keeping the float matrix.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int8
from torch import Tensor, nn

from scratchlm.device.planning import Plan
from scratchlm.errors import ScratchlmError
from scratchlm.kernels import int8_cpu
from scratchlm.model.layers import Embedding, Linear

# The schemes `--quantize` takes (`scratchlm.cli.options`); None: the plan's precision throughout.
QUANTIZE_SCHEMES = ("int8",)
INT8_MAX = 127  # symmetric: -127..127, so that -q is representable for every q


def quantize_per_channel(
    weight: Float[Tensor, "out d_in"],
) -> tuple[Int8[Tensor, "out d_in"], Float[Tensor, " out"]]:
    """`(q, scale)` with `weight ≈ q * scale[:, None]`: one symmetric scale per output row, `max|w| / 127`
    (an all-zero row gets scale 1, its integers all 0), computed in float32."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: Int8[Tensor, "out d_in"], scale: Float[Tensor, " out"]) -> Float[Tensor, "out d_in"]:
    """The float32 matrix that `q` and `scale` stand for."""
    return q.float() * scale.float()[:, None]


def quantized_linears(model: nn.Module) -> list[Linear]:
    """The `Linear`s that `--quantize` turns to int8: every one of the model (blocks' projections, FFN, head)."""
    return [module for module in model.modules() if isinstance(module, Linear)]


def check_scheme(scheme: str | None, option: str = "--quantize") -> None:
    """A one-line error for a scheme this module does not know."""
    if scheme is not None and scheme not in QUANTIZE_SCHEMES:
        raise ScratchlmError(f"{option} {scheme}: unknown scheme; choose {' or '.join(QUANTIZE_SCHEMES)}")


def quantize_weights(
    model: nn.Module, scheme: str, dtype: torch.dtype, option: str = "--quantize"
) -> nn.Module:
    """`model`'s `Linear`s held as `scheme` (int8 per output channel), their scales in `dtype` (the plan's),
    in place; before the stacks are fused (`lay_out_for_inference` stacks the int8 rows and their scales).
    Quantized from the weights as loaded, not from a lower precision. A model already quantized is left."""
    check_scheme(scheme, option)
    linears = quantized_linears(model)
    if not linears:
        raise ScratchlmError(f"{option} {scheme}: the model has no weight matrices to quantize")
    for linear in linears:
        shape = tuple(linear.weight.shape)
        if linear.weight_scale is None and not (len(shape) == 2 and linear.weight.is_floating_point()):
            raise ScratchlmError(
                f"{option} {scheme}: cannot quantize a weight of shape {shape} ({linear.weight.dtype}) per "
                "output channel"
            )
    tied = {id(m.weight) for m in model.modules() if isinstance(m, Embedding)}
    for linear in linears:
        if linear.weight_scale is not None:
            continue
        q, scale = quantize_per_channel(linear.weight)
        if id(linear.weight) in tied:
            # A tied head: the embedding table keeps the float matrix, the head its own int8 copy.
            linear.weight = nn.Parameter(q, requires_grad=False)
        else:
            linear.weight.requires_grad_(False)
            linear.weight.data = q
        linear.weight_scale = scale.to(dtype=dtype, device=q.device)
    if linears[0].weight.device.type == "cpu":
        # scratchlm's int8 kernel, built now (once per machine, said when it is) rather than inside the first
        # step that calls it; where it cannot build, the layers keep PyTorch's forms.
        int8_cpu.load()
    return model


def weight_bytes(model: nn.Module, held_in: torch.dtype | None = None) -> int:
    """The bytes of the matrices that are multiplied (every `Linear`'s weight and scales), each tensor once;
    with `held_in`, what the weights would take in that dtype instead."""
    seen, total = set(), 0
    for linear in quantized_linears(model):
        for tensor in (linear.weight, linear.weight_scale):
            if tensor is not None and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                size = tensor.element_size() if held_in is None else held_in.itemsize
                total += tensor.numel() * size
    return total


def describe(scheme: str | None, plan: Plan) -> str:
    """What `--quantize scheme` does under `plan` (its device, its activations' dtype, and how it runs an eager
    int8 product, `Plan.int8_matmul`): the line a command prints and `scratchlm doctor` shows."""
    precision = str(plan.dtype).removeprefix("torch.")
    if scheme is None:
        return f"off: every weight in {precision} (--quantize int8: the matrices in int8, a quarter of fp32's bytes)"
    kernel = {
        "pack": "aten._weight_int8pack_mm",
        "kernel": "scratchlm's int8 kernel up to 16 rows, the weight dequantized into a larger product",
    }.get(plan.int8_matmul.value, "the weight dequantized into the product")
    return (
        f"{scheme} weights per output channel: the blocks' matrices and the LM head (eager: {kernel}; a "
        f"compiled decode step on a CPU: scratchlm's int8 kernel); embeddings, norms and KV cache in {precision}"
    )
