"""The building blocks of a LLaMA-style Transformer, each written from tensor operations.

In the order a token meets them:

- `Embedding`: row lookup in a `(vocab, d_model)` matrix.
- `RMSNorm`: `a / sqrt(mean(a²) + eps) * g` (Zhang & Sennrich, 2019), computed in at least float32.
- `MultiHeadSelfAttention` (`scratchlm.model.attention`): causal `softmax(Q Kᵀ / sqrt(d_k)) V` with the heads
  as a batch dimension, queries and keys rotated by `RotaryPositionalEmbedding` (`scratchlm.model.positions`;
  RoPE, Su et al., 2021) so that a score depends only on how far apart two tokens are.
- `SwiGLU` (`scratchlm.model.ffn`): the gated feed-forward network `W2 (silu(W1 x) ⊙ W3 x)` (Shazeer, 2020),
  or one of its ablations.
- `Linear`: `y = x Wᵀ` without bias, `W` stored `(out, in)` as in the reference implementation.

Every function accepts extra leading batch dimensions (`...`). Low-precision inputs (bfloat16 under
`torch.autocast`) are normalised and soft-maxed in float32, because a sum of squares or of exponentials over
hundreds of bfloat16 values loses most of its digits.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from scratchlm.kernels import int8_cpu
from scratchlm.kernels.int8_cpu import ROWS_AT_MOST
from scratchlm.model.config import DEFAULT_NORM_EPS
from scratchlm.model.part import Device, DType


def _truncated_normal(rows: int, cols: int, std: float, device: Device, dtype: DType) -> nn.Parameter:
    weight = torch.empty(rows, cols, device=device, dtype=dtype)
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return nn.Parameter(weight)


def at_least_float32(x: Tensor) -> Tensor:
    """`x` in float32 if it is in a lower precision (bfloat16, float16); float32 and float64 are kept."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def autocasting(x: Tensor) -> bool:
    """Whether autocast is on for `x`'s device (it then picks the products' dtype itself)."""
    return torch.is_autocast_enabled(x.device.type)


class _UpcastLinear(torch.autograd.Function):
    """`y = x Wᵀ` for a frozen `W` stored in a lower precision than `x` (bfloat16 under float32), computed in
    `x`'s dtype.

    The obvious `x @ W.float().T` is right but costs the memory it was meant to save: autograd keeps every
    input of the product for the backward pass, so the float32 copy of `W` stays alive until then, one per
    matrix, as activations, and the saving of holding `W` in 16 bits is lost. The chain rule says what the
    backward needs instead. With `y = x Wᵀ` and the upstream gradient `g = ∂L/∂y`,

        ∂L/∂x = g W          (each x_i reaches every y_j through W_ji)
        ∂L/∂W = gᵀ x         (not wanted: W is frozen)

    so the backward needs `W` alone, not `x`, and `W` can be saved as it is stored (16 bits) and upcast
    again there: one more conversion a matrix per step, against 2 bytes a weight held for the whole step.
    Upcasting is exact (every bfloat16 is a float32), so the result is the product with the upcast weight.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        return x @ weight.to(x.dtype).T

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None


def upcast_linear(
    x: Float[Tensor, "... d_in"], weight: Float[Tensor, "d_out d_in"]
) -> Float[Tensor, "... d_out"]:
    """`x Wᵀ` in `x`'s dtype for a frozen `weight` held in fewer bits, saving only the stored `weight` for the
    backward pass (`_UpcastLinear`); the weight gets no gradient."""
    return _UpcastLinear.apply(x, weight)


class Linear(nn.Module):
    """`y = x Wᵀ`, no bias. Init `N(0, 2 / (in + out))` truncated at ±3σ, which keeps the variance of
    activations and of gradients about constant through the layer (Glorot & Bengio, 2010)."""

    def __init__(
        self, in_features: int, out_features: int, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        std = math.sqrt(2.0 / (in_features + out_features))
        self.weight = _truncated_normal(out_features, in_features, std, device, dtype)
        # W by rows, for a compiled decode step on a CPU, where `weight` is held by columns
        # (`hold_rows_for_decoding`); None: `weight` itself.
        self.weight_by_rows: Tensor | None = None
        # With weight-only int8 (`scratchlm.generation.quantize`), `weight` holds int8 and this its scale per
        # output row, `W ≈ weight * weight_scale[:, None]`. A buffer, so that a compiled step takes it as an
        # input; not persistent, so that the state dict keeps its keys.
        self.register_buffer("weight_scale", None, persistent=False)
        # How the int8 product runs eagerly (`int8_matmul`'s `form`): `Plan.int8_matmul`'s choice, set by the
        # inference layout (`lay_out_for_inference`).
        self.int8_form = "dequantize"

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if self.weight_scale is not None:
            return int8_matmul(x, self.weight, self.weight_scale, self.int8_form)
        if tracing_cpu_step(x):
            # A compiled decode step on a CPU (`scratchlm.generation.decode`) reads W by rows (a copy where
            # `weight` is held by columns, `hold_rows_for_decoding`); measured on a 2-core Zen 3 EPYC with
            # the TinyStories model:
            by_rows = self.weight if self.weight_by_rows is None else self.weight_by_rows
            if by_rows.stride(-1) == 1:
                if x.numel() == x.shape[-1]:
                    # One token: written as a product and a sum over W's rows, the matrix-vector product
                    # becomes a loop Inductor generates, vectorised and spread over the threads, reading each
                    # row of W once (15.7 GB/s, against 5 for the BLAS's kernel, which runs on one thread).
                    return (x.unsqueeze(-2) * by_rows).sum(-1)
                # A few tokens (a batched step): the BLAS multiplies W by the tokens as columns faster than
                # the tokens by Wᵀ (a step of 4 rows 8.0 ms against 18.1, of 16 rows 20.4 against 26.3).
                tokens = x.reshape(-1, x.shape[-1])
                return (by_rows @ tokens.T).T.reshape(*x.shape[:-1], by_rows.shape[0])
        if self.weight.dtype != x.dtype and not self.weight.requires_grad and not autocasting(x):
            # A frozen W held in fewer bits than the input computes in (a LoRA base stored in bf16 on a
            # float32 plan): upcast at use, keeping no upcast copy for the backward pass.
            return upcast_linear(x, self.weight)
        # `matmul` folds the leading dimensions into one (tokens × d_in) @ (d_in × d_out) product; an einsum
        # over "..." would run a batched product against an expanded copy of W, twice as slow on CPU.
        return x @ self.weight.T

    def adapters(self) -> list[nn.Parameter]:
        """Trainable parameters added to this matrix (LoRA's, `scratchlm.model.lora`); none for a plain one."""
        return []

    def as_one_product(
        self, x: Float[Tensor, "... d_in"]
    ) -> tuple[Float[Tensor, "... d"], Float[Tensor, "d_out d"]]:
        """`(x', W')` with `x' W'ᵀ` this layer's output: what takes the product whole, the fused LM head and
        loss (`scratchlm.model.loss`). For a plain matrix, `(x, W)`."""
        return x, self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


# Set while a decode step is traced into a graph outside Dynamo (`scratchlm.generation.decode` on a CPU); a
# context variable, so that a thread tracing does not change the layers of another running eagerly.
_TRACING_STEP = contextvars.ContextVar("tracing_step", default=False)


@contextlib.contextmanager
def tracing_step() -> Iterator[None]:
    """Run the model as a compiled step does (`in_compiled_step`) while a step is traced into a graph."""
    token = _TRACING_STEP.set(True)
    try:
        yield
    finally:
        _TRACING_STEP.reset(token)


def tracing_cpu_step(x: Tensor) -> bool:
    """Whether `x` is a CPU decode step's, being traced into a graph (`tracing_step`). Never under Dynamo,
    which compiles other steps (training's) and cannot read a context variable."""
    return not torch.compiler.is_compiling() and _TRACING_STEP.get() and x.device.type == "cpu"


def in_compiled_step() -> bool:
    """Whether the forward pass is being traced into a compiled graph (by Dynamo, or by `tracing_step`), where
    each operation runs with no Python between them and the layers take the forms that compile best."""
    return torch.compiler.is_compiling() or _TRACING_STEP.get()


class LinearStack:
    """Several `Linear`s that read the same input (attention's q, k and v projections; SwiGLU's W1 and W3):
    called on `x`, the tuple of their outputs. After `fuse()` (inference, `lay_out_for_inference`) they are
    one matmul over their weights stacked into one matrix.

    Decoding a token multiplies one row by each weight matrix: one matrix-vector product over the stack pays
    the per-call overhead once instead of once a matrix, and streams one long matrix instead of several short
    ones. The `Linear`s keep their parameters, and the state dict its keys: each weight becomes the view of its
    rows of the stack, so there is one copy of the weights, and writing a weight in place (loading a state
    dict) writes the stack.

    The stack is not a parameter, so it is used without autograd only; with gradients recorded (training) the
    `Linear`s run one by one. Once a weight no longer lies in the stack (moved by `.to()`, replaced), the
    stack is let go and the `Linear`s run one by one too, as they do in a compiled step."""

    def __init__(self, *linears: Linear) -> None:
        self.linears = linears
        self.weight: Tensor | None = None
        self.scale: Tensor | None = None  # the rows' int8 scales, where the `Linear`s hold int8
        self.int8_form = "dequantize"  # as `Linear.int8_form`, for the stack's product
        self._addresses: list[int] = []

    def fuse(self, wide_by_columns: bool = False) -> None:
        """Stack the weights (held by columns if the stack is wide and `wide_by_columns`; int8 weights always
        by rows, with their scales stacked too)."""
        sizes = [linear.weight.shape[0] for linear in self.linears]
        stack = torch.cat([linear.weight.detach() for linear in self.linears])
        scales = [linear.weight_scale for linear in self.linears]
        int8 = all(scale is not None for scale in scales)
        self.scale = torch.cat(scales) if int8 else None
        self.weight = by_columns(stack) if wide_by_columns and is_wide(stack) and not int8 else stack
        for linear, rows in zip(self.linears, self.weight.split(sizes), strict=True):
            linear.weight.data = rows
        if self.scale is not None:
            for linear, scale in zip(self.linears, self.scale.split(sizes), strict=True):
                linear.weight_scale = scale
        self._addresses = [linear.weight.data_ptr() for linear in self.linears]

    def holds_its_weights(self) -> bool:
        """Whether the stack is fused and every `Linear`'s weight still lies in it; a stack whose weights have
        left it (moved, replaced) is let go here."""
        if self.weight is not None and [lin.weight.data_ptr() for lin in self.linears] != self._addresses:
            self.weight = None  # a weight has left the stack: free it
        return self.weight is not None

    def __call__(self, x: Float[Tensor, "... d_in"]) -> tuple[Float[Tensor, "... d_out"], ...]:
        sizes = [linear.out_features for linear in self.linears]
        if torch.is_grad_enabled():
            return tuple(linear(x) for linear in self.linears)
        if tracing_cpu_step(x):
            # A compiled CPU step (`scratchlm.generation.decode`), traced after `check_stacks`: float matrices
            # one by one (Inductor writes their loops, the stack would save nothing); an int8 stack in one
            # call of the kernel, an extern call each, whose overhead the stack pays once (17 calls a step of
            # the TinyStories shape rather than 29). The stack and its scales are the graph's constants.
            rows = x.numel() // max(1, x.shape[-1])
            if self.weight is not None and self.scale is not None and rows <= ROWS_AT_MOST:
                return int8_matmul(x, self.weight, self.scale).split(sizes, dim=-1)
        elif not in_compiled_step() and self.holds_its_weights():
            assert self.weight is not None
            if self.scale is None:
                y = x @ self.weight.T
            else:
                y = int8_matmul(x, self.weight, self.scale, self.int8_form)
            return y.split(sizes, dim=-1)
        return tuple(linear(x) for linear in self.linears)


def check_stacks(model: nn.Module) -> None:
    """Let go every `LinearStack` of `model` whose weights have left it (`LinearStack.holds_its_weights`):
    called before a step is traced, where the stacks' addresses cannot be read (fake tensors)."""
    for module in model.modules():
        for stack in [value for value in vars(module).values() if isinstance(value, LinearStack)]:
            stack.holds_its_weights()


def is_wide(matrix: Tensor) -> bool:
    """More outputs than inputs (a `(out, in)` weight)."""
    return matrix.shape[0] > matrix.shape[1]


def by_columns(matrix: Float[Tensor, "out d_in"]) -> Float[Tensor, "out d_in"]:
    """The same matrix, held column after column: `matrix.T` is contiguous, so `x @ matrix.T` multiplies by a
    row-major `(in, out)` matrix."""
    return matrix.T.contiguous().T


def lay_out_for_inference(model: nn.Module, wide_by_columns: bool, int8_form: str = "dequantize") -> None:
    """Inference's layout of `model`'s weights (`prepare_for_inference`): every `LinearStack` fused, and, with
    `wide_by_columns` (`Plan.matvec` "columns"), every wide matrix held by columns: the stacks and the `Linear`s
    of no stack (the LM head); without it, by rows. Values are unchanged; only where they lie in memory. Every
    `Linear` and stack takes `int8_form` (`Plan.int8_matmul`: "pack", "kernel" or "dequantize"), which its int8
    products, if any, follow eagerly (`int8_matmul`)."""
    stacked = set()
    for module in model.modules():
        for stack in [value for value in vars(module).values() if isinstance(value, LinearStack)]:
            stack.fuse(wide_by_columns)
            stack.int8_form = int8_form
            stacked.update(id(linear) for linear in stack.linears)
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        module.int8_form = int8_form
        if id(module) not in stacked and is_wide(module.weight):
            weight = module.weight.data
            by_cols = wide_by_columns and module.weight_scale is None  # int8 is read by rows
            module.weight.data = by_columns(weight) if by_cols else weight.contiguous()


def int8_matmul(
    x: Float[Tensor, "... d_in"],
    weight: Int[Tensor, "out d_in"],
    scale: Float[Tensor, " out"],
    form: str = "dequantize",
) -> Float[Tensor, "... out"]:
    """`x @ (weight * scale[:, None]).T` for an int8 `weight` with one scale per output row (weight-only int8,
    `scratchlm.generation.quantize`), in `x`'s dtype, without a float copy of the weight where it can be
    helped: the scale factors out of each row's dot product, `y_j = scale_j · Σ_i x_i weight_ji`.

    Eagerly, as `form` says: "kernel", scratchlm's CPU kernel (`scratchlm.kernels.int8_cpu.matmul`) for up to
    `ROWS_AT_MOST` rows of activations (up to `Q8_ROWS_AT_MOST` rows its int8 x int8 form, which quantizes the
    activations per block of 32 as llama.cpp's Q8_0 does, adding their rounding to the weights'); "pack", PyTorch's `aten._weight_int8pack_mm`; "dequantize" (and
    "kernel" beyond its rows: prefill), the weight dequantized into a matmul. Which is faster depends on the
    CPU and the dtype, so the device plan measures them and chooses (`Plan.int8_matmul`), and the layout hands
    the choice to each layer (`Linear.int8_form`). In a compiled decode step on a CPU, scratchlm's kernel for
    up to `ROWS_AT_MOST` rows wherever it builds, called from Inductor's generated code; else, for one token,
    the product and sum over the int8 rows, which Inductor writes as a loop converting the int8 in registers
    (measured on a 2-core Zen 3 EPYC, AVX2, 2688 x 512, one token: that loop 1.9 ms, its int8 loads going 8
    at a time through a slow conversion; the kernel 0.09 ms, float32's matrix-vector product 0.17)."""
    rows = x.numel() // max(1, x.shape[-1])
    if tracing_cpu_step(x):
        if rows <= ROWS_AT_MOST and int8_cpu.load():
            return int8_cpu.matmul(x, weight, scale)
        if rows == 1:
            # One token: the product and sum over the rows, as for float weights; `x * weight` promotes the
            # int8 in the generated loop.
            return ((x.unsqueeze(-2) * weight).sum(-1) * scale).to(x.dtype)
    if form == "kernel" and rows <= ROWS_AT_MOST and x.device.type == "cpu" and int8_cpu.load():
        return int8_cpu.matmul(x, weight, scale)
    tokens = x.reshape(-1, x.shape[-1])
    if form == "pack":
        y = torch.ops.aten._weight_int8pack_mm(tokens.contiguous(), weight, scale.to(x.dtype))
    else:
        y = (tokens @ weight.to(x.dtype).T) * scale.to(x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def hold_rows_for_decoding(model: nn.Module) -> None:
    """Give every `Linear` whose weight is held by columns (`lay_out_for_inference`) a copy by rows, which a
    compiled decode step on a CPU reads (`Linear.forward`); everything else keeps reading the columns.
    The copies cost the wide matrices' memory once more, and are taken now: weights changed later are not
    seen by compiled steps."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.stride(-1) != 1:
            module.weight_by_rows = module.weight.detach().contiguous()


class Embedding(nn.Module):
    """Token id -> row of a `(num_embeddings, embedding_dim)` matrix; init `N(0, 1)` truncated at ±3."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _truncated_normal(num_embeddings, embedding_dim, 1.0, device, dtype)
        # The dtype rows are returned in where the table is stored in fewer bits (a frozen LoRA base,
        # `scratchlm.model.lora`): the residual stream keeps the precision it has with the table in it.
        self.compute_dtype: torch.dtype | None = None

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of the rows it returns: `compute_dtype`, else the table's."""
        return self.compute_dtype or self.weight.dtype

    def forward(self, token_ids: Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        rows = self.weight[token_ids]
        return rows if self.compute_dtype is None else rows.to(self.compute_dtype)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RMSNorm(nn.Module):
    """`a_i / RMS(a) * g_i` with `RMS(a) = sqrt(mean(a²) + eps)`; the gain `g` starts at 1.

    Computed in float32 and returned in the input's dtype: under bfloat16 the mean of squares of
    d_model values would keep only about three significant digits.
    """

    def __init__(
        self, d_model: int, eps: float = DEFAULT_NORM_EPS, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x32 = at_least_float32(x)
        inv_rms = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * at_least_float32(self.weight)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
