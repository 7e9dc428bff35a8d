"""A draft layer's norms and activation folded into the small-rows matmul that follows them.

Between the four matmuls of an assistant layer (``ops/small_linear.py``) a draft step runs
elementwise kernels: the input norm before the query projection, the residual add with its
sandwich norms before gate/up, the gated GELU before down, and the scaled residual with the
next layer's input norm (the final norm after the last layer). Each is one fused kernel under
torch.compile, but at a draft step's few rows every kernel costs its launch, not its bytes.
Here each is the *prologue* of the matmul that reads its result: the kernel computes its input
tile from the prologue's inputs (``ops/small_linear_triton.py``, ``PROLOGUE``), so a layer
runs four launches instead of eight.

Three ops, each defined by its plain torch reference (today's module composition, eagerly):

- ``rms_norm_linear``: ``x = rmsnorm(v, w)``, ``out = x @ W^T`` (NORM);
- ``residual_rms_norm_linear``: ``h = (r + rmsnorm(a, w_post)) [* s]``,
  ``x = rmsnorm(h, w_pre)``, ``out = x @ W^T`` (RESIDUAL_NORM; ``h`` is the next residual);
- ``gelu_tanh_mul_linear``: ``x = gelu_tanh(g[:, :I]) * g[:, I:]``, ``out = x @ W^T``
  (ACT_MUL).

``rmsnorm`` is vLLM's ``RMSNorm``: float32 ``v * rsqrt(mean(v^2) + eps)``, rounded to the
weight's dtype, times the weight (the assistant's norms multiply by the weight, not 1 + it);
the GELU is vLLM's ``GeluAndMul(approximate="tanh")``; each intermediate is rounded to the
activations' dtype where torch's eager ops round it, and the kernel rounds at the same places.
The norm ops also return the normed ``x`` when asked (the final norm's output is the draft's
hidden state as well as the post-projection's input).

Where the few-rows kernel applies (``prologue_fuses``: at most ``SMALL_LINEAR_MAX_ROWS`` rows)
the op is one launch. Past that (a draft prefill, a large batch) the standalone prologue kernel
writes ``x`` (and ``h``) in one launch and ``F.linear`` multiplies: the two launches the
unfused path runs too. Without Triton (CPU outside the interpreter) the reference runs. Like
``small_linear``, the ops are opaque to torch.compile, which traces them through their fakes
with a dynamic row count; their outputs are fresh tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from gemma4_spec.ops.centroid_argmax_triton import triton_usable
from gemma4_spec.ops.small_linear import (
    SMALL_LINEAR_DTYPES,
    SMALL_LINEAR_MAX_ROWS,
    small_linear_reference,
)
from gemma4_spec.ops.small_linear_triton import (
    PROLOGUE_ACT_MUL,
    PROLOGUE_NORM,
    PROLOGUE_RESIDUAL_NORM,
    Prologue,
    prologue_kernel,
    prologue_linear_kernel,
)

# --------------------------------------------------------------------------------------------
# References (the definitions)
# --------------------------------------------------------------------------------------------


def rms_norm_reference(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's ``RMSNorm`` (weight times the normed value) in ``v``'s dtype."""
    vf = v.float()
    normed = vf * torch.rsqrt(vf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(v.dtype)


def residual_reference(
    a: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    eps_post: float,
    scalar: torch.Tensor | None,
) -> torch.Tensor:
    """``(residual + rmsnorm(a, post_weight)) [* scalar]`` in ``a``'s dtype: a sandwich
    block's residual after a sub-layer (with the layer's scalar after the MLP)."""
    h = residual + rms_norm_reference(a, post_weight, eps_post)
    return h if scalar is None else (h * scalar).to(a.dtype)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``[..., 2I]`` = ``gate | up``, as vLLM's ``GeluAndMul``."""
    width = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :width], gate_up[..., width:]
    return nn.functional.gelu(gate, approximate="tanh") * up


def rms_norm_linear_reference(
    v: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rmsnorm(v) @ weight^T``, ``rmsnorm(v)``)."""
    x = rms_norm_reference(v, norm_weight, eps)
    return small_linear_reference(x, weight), x


def residual_rms_norm_linear_reference(
    a: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    eps_post: float,
    scalar: torch.Tensor | None,
    pre_weight: torch.Tensor,
    eps_pre: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x @ weight^T``, ``h``, ``x``) with ``h = residual_reference(...)`` and
    ``x = rmsnorm(h, pre_weight)``."""
    h = residual_reference(a, residual, post_weight, eps_post, scalar)
    x = rms_norm_reference(h, pre_weight, eps_pre)
    return small_linear_reference(x, weight), h, x


def gelu_tanh_mul_linear_reference(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(gelu_tanh(gate) * up) @ weight^T``."""
    return small_linear_reference(gelu_tanh_mul_reference(gate_up), weight)


# --------------------------------------------------------------------------------------------
# Where the kernels run
# --------------------------------------------------------------------------------------------


def prologue_triton_applies(
    x: torch.Tensor, weight: torch.Tensor, depth: int, *vectors: torch.Tensor
) -> bool:
    """Whether the Triton prologue (fused or standalone) can run on these operands: a device
    Triton runs on, at least one row, one dtype throughout (``vectors``: the norm weights),
    a weight ``[N, depth]`` and vectors ``[depth]`` contiguous along K."""
    return (
        triton_usable(x.device)
        and x.numel() > 0
        and x.dtype in SMALL_LINEAR_DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == depth
        and weight.stride(1) == 1
        and all(v.dtype == x.dtype and v.shape == (depth,) and v.is_contiguous() for v in vectors)
    )


def prologue_fuses(x: torch.Tensor) -> bool:
    """Whether the prologue runs inside the few-rows matmul (else before ``F.linear``)."""
    return x.numel() // x.shape[-1] <= SMALL_LINEAR_MAX_ROWS


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, width]``, contiguous (the kernels' layout)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _run(
    x: torch.Tensor, weight: torch.Tensor, mode: int, **operands: object
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, h, x) of the prologue ``mode`` and its matmul, under ``x``'s leading dimensions:
    one fused launch at few rows, else the standalone prologue, then ``F.linear``."""
    lead = x.shape[:-1]
    prologue = Prologue(mode, **operands)  # type: ignore[arg-type]
    if prologue_fuses(x):
        out, h, xo = prologue_linear_kernel(_rows(x), weight, prologue)
    else:
        xo, h = prologue_kernel(_rows(x), prologue)
        out = nn.functional.linear(xo, weight)
    return (
        out.reshape(*lead, out.shape[-1]),
        None if h is None else h.reshape(*lead, h.shape[-1]),
        None if xo is None else xo.reshape(*lead, xo.shape[-1]),
    )


def _if_asked(x: torch.Tensor | None, write_x: bool, like: torch.Tensor) -> torch.Tensor:
    """The normed input where asked for, else an empty tensor (the ops' outputs are fixed)."""
    return x if write_x and x is not None else like.new_empty(0)


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("gemma4_spec::rms_norm_linear", mutates_args=())
def rms_norm_linear(
    v: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, write_x: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rmsnorm(v, norm_weight) @ weight^T``, the normed ``v`` if ``write_x`` else an
    empty tensor) in ``v``'s dtype (NORM; module docstring)."""
    if not prologue_triton_applies(v, weight, v.shape[-1], norm_weight):
        out, x = rms_norm_linear_reference(v, norm_weight, eps, weight)
        return out, _if_asked(x, write_x, out)
    out, _, x = _run(v, weight, PROLOGUE_NORM, pre_weight=norm_weight, eps_pre=eps, write_x=write_x)
    return out, _if_asked(x, write_x, out)


@rms_norm_linear.register_fake
def _(
    v: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, write_x: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return v.new_empty((*v.shape[:-1], weight.shape[0])), v.new_empty(v.shape if write_x else 0)


@torch.library.custom_op("gemma4_spec::residual_rms_norm_linear", mutates_args=())
def residual_rms_norm_linear(
    a: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    eps_post: float,
    scalar: torch.Tensor | None,
    pre_weight: torch.Tensor,
    eps_pre: float,
    weight: torch.Tensor,
    write_x: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x @ weight^T``, ``h``, ``x`` if ``write_x`` else an empty tensor) with
    ``h = (residual + rmsnorm(a, post_weight)) [* scalar]`` and ``x = rmsnorm(h, pre_weight)``,
    in ``a``'s dtype (RESIDUAL_NORM; module docstring)."""
    fits = (
        residual.shape == a.shape
        and residual.dtype == a.dtype
        and (scalar is None or scalar.numel() == 1)
        and prologue_triton_applies(a, weight, a.shape[-1], post_weight, pre_weight)
    )
    if not fits:
        out, h, x = residual_rms_norm_linear_reference(
            a, residual, post_weight, eps_post, scalar, pre_weight, eps_pre, weight
        )
        return out, h, _if_asked(x, write_x, out)
    out, h, x = _run(
        a, weight, PROLOGUE_RESIDUAL_NORM, residual=_rows(residual), post_weight=post_weight,
        pre_weight=pre_weight, scalar=scalar, eps_post=eps_post, eps_pre=eps_pre,
        write_x=write_x,
    )  # fmt: skip
    assert h is not None
    return out, h, _if_asked(x, write_x, out)


@residual_rms_norm_linear.register_fake
def _(
    a: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    eps_post: float,
    scalar: torch.Tensor | None,
    pre_weight: torch.Tensor,
    eps_pre: float,
    weight: torch.Tensor,
    write_x: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = a.new_empty((*a.shape[:-1], weight.shape[0]))
    return out, a.new_empty(a.shape), a.new_empty(a.shape if write_x else 0)


@torch.library.custom_op("gemma4_spec::gelu_tanh_mul_linear", mutates_args=())
def gelu_tanh_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(gelu_tanh(gate) * up) @ weight^T`` of ``gate_up = [..., gate | up]``, in its dtype
    (ACT_MUL; module docstring)."""
    if not prologue_triton_applies(gate_up, weight, gate_up.shape[-1] // 2):
        return gelu_tanh_mul_linear_reference(gate_up, weight)
    return _run(gate_up, weight, PROLOGUE_ACT_MUL)[0]


@gelu_tanh_mul_linear.register_fake
def _(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))
