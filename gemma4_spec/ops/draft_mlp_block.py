"""The assistant's work between two attentions, from the attention's output to the next layer's
normed input, defined in plain torch: what ``ops/draft_mlp_block_triton.py`` computes in one
launch.

For a draft layer with attention output ``o [T, Q]`` and residual stream ``h [T, H]``:

    a  = o @ Wo^T                                  # the output projection, [T, H]
    h1 = h + rms(a) * post_attention_norm
    x  = rms(h1) * pre_feedforward_norm
    m  = gelu_tanh(x @ Wg^T) * (x @ Wu^T)          # Wgu = [Wg; Wu], [2I, H]
    d  = m @ Wd^T                                  # [T, H]
    h2 = (h1 + rms(d) * post_feedforward_norm) * layer_scalar
    x' = rms(h2) * next_norm                       # the next layer's input norm, or the final one

with ``rms(v) = v / sqrt(mean(v^2) + eps)`` over the last dimension. It returns ``(h2, x')``.

Why one launch: at a draft step's few rows each of these matmuls reads 0.5-2 MB of weights, a
microsecond of the GPU's bandwidth, and each of the five launches they take now (output
projection, its residual norm, gate/up with the activation, down projection, its residual norm)
costs 3-4 us in a CUDA graph, mostly the wait between dependent kernels
(``benchmarks/draft_chain.py``). The kernel runs the five as stages of one persistent launch
with grid barriers between them (``ops/draft_mlp_block_triton.py``).

``draft_mlp_block`` (the custom op ``gemma4_spec::draft_mlp_block``) runs the kernel where it
applies and the layer's own ops one by one otherwise (``draft_mlp_block_unfused``: more rows
than the kernel takes, strided operands, no Triton). The assistant routes its layers through it
when ``GEMMA4_SPEC_DRAFT_BLOCK=1`` (opt-in, ``uses_draft_block``) on CUDA with one
tensor-parallel rank. The draft's tokens may change where two draft logits are within rounding
of each other (the kernel rounds where the unfused layer does, but sums in another order); the
target verifies every draft, so the output does not.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from gemma4_spec.ops.centroid_argmax_triton import triton_usable
from gemma4_spec.ops.custom_ops import custom_op
from gemma4_spec.ops.small_linear import FUSED_ACTIVATION, gelu_and_mul_formula
from gemma4_spec.switches import turned_on

DRAFT_BLOCK_ENV = "GEMMA4_SPEC_DRAFT_BLOCK"


class MlpBlockWeights(NamedTuple):
    """One draft layer's weights from its output projection on, and the next norm's gain."""

    o_proj: torch.Tensor  # [H, Q]
    gate_up: torch.Tensor  # [2I, H]: the gate's rows, then the up projection's
    down: torch.Tensor  # [H, I]
    post_attention_norm: torch.Tensor  # [H]
    pre_feedforward_norm: torch.Tensor  # [H]
    post_feedforward_norm: torch.Tensor  # [H]
    next_norm: torch.Tensor  # [H]
    layer_scalar: torch.Tensor  # [1]


def _rms(v: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gain.float()


def draft_mlp_block_reference(
    attn: torch.Tensor, h: torch.Tensor, w: MlpBlockWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h2, x')`` of the module docstring in float32 maths, each in ``h``'s dtype."""
    a = attn.float() @ w.o_proj.float().t()
    h1 = h.float() + _rms(a, w.post_attention_norm, eps)
    x = _rms(h1, w.pre_feedforward_norm, eps)
    m = gelu_and_mul_formula(x @ w.gate_up.float().t())  # float32 in, float32 out
    d = m @ w.down.float().t()
    h2 = (h1 + _rms(d, w.post_feedforward_norm, eps)) * w.layer_scalar.float()
    x_next = _rms(h2, w.next_norm, eps)
    return h2.to(h.dtype), x_next.to(h.dtype)


def draft_mlp_block_unfused(
    attn: torch.Tensor, h: torch.Tensor, w: MlpBlockWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h2, x')`` by the layer's own ops in the model dtype: the matmuls, vLLM's RMS norm
    (float32 statistics, rounded, then the gain) and the gated activation one by one."""
    dtype = h.dtype

    def norm(v: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        v32 = v.float()
        return (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * gain

    linear = nn.functional.linear
    h1 = h + norm(linear(attn, w.o_proj), w.post_attention_norm)
    m = gelu_and_mul_formula(linear(norm(h1, w.pre_feedforward_norm), w.gate_up))
    h2 = (h1 + norm(linear(m, w.down), w.post_feedforward_norm)) * w.layer_scalar
    return h2, norm(h2, w.next_norm)


def block_operands_problem(attn: torch.Tensor, h: torch.Tensor, w: MlpBlockWeights) -> str | None:
    """What keeps ``draft_mlp_block_kernel`` from these operands, or None: the rows it takes,
    the shapes the weights must have, contiguity."""
    from gemma4_spec.ops.draft_mlp_block_triton import MAX_ROWS

    if attn.dim() != 2 or h.dim() != 2 or h.shape[0] != attn.shape[0]:
        return "the attention output and the residual must be [rows, width] with equal rows"
    rows, hidden, width = attn.shape[0], h.shape[1], w.down.shape[-1]
    if rows > MAX_ROWS:
        return f"{rows} rows, the kernel takes up to {MAX_ROWS}"
    if (
        w.o_proj.shape != (hidden, attn.shape[1])
        or w.gate_up.shape != (2 * width, hidden)
        or w.down.shape != (hidden, width)
    ):
        return "the projections' shapes do not match the attention output and the residual"
    if attn.stride(-1) != 1 or h.stride(-1) != 1 or not all(t.is_contiguous() for t in w):
        return (
            "the rows of the attention output and the residual, and every weight, must be "
            "contiguous (.contiguous() them)"
        )
    return None


def draft_mlp_block_applies(attn: torch.Tensor, h: torch.Tensor, w: MlpBlockWeights) -> bool:
    """Whether ``draft_mlp_block`` runs the kernel for these operands (else the unfused ops)."""
    return (
        triton_usable(attn.device)
        and all(t.device == attn.device for t in (h, *w))
        and block_operands_problem(attn, h, w) is None  # two dimensions among its checks
        and attn.shape[0] > 0
    )


def _block_like(
    attn: torch.Tensor,
    h: torch.Tensor,
    o_proj: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    post_attention_norm: torch.Tensor,
    pre_feedforward_norm: torch.Tensor,
    post_feedforward_norm: torch.Tensor,
    next_norm: torch.Tensor,
    layer_scalar: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``draft_mlp_block`` returns, for torch.compile's tracing."""
    return torch.empty_like(h), torch.empty_like(h)


@custom_op("draft_mlp_block", fake=_block_like)
def draft_mlp_block(
    attn: torch.Tensor,
    h: torch.Tensor,
    o_proj: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    post_attention_norm: torch.Tensor,
    pre_feedforward_norm: torch.Tensor,
    post_feedforward_norm: torch.Tensor,
    next_norm: torch.Tensor,
    layer_scalar: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h2, x')`` of the module docstring: one persistent launch where the kernel applies,
    the unfused ops otherwise."""
    w = MlpBlockWeights(
        o_proj, gate_up, down, post_attention_norm, pre_feedforward_norm,
        post_feedforward_norm, next_norm, layer_scalar,
    )  # fmt: skip
    if not draft_mlp_block_applies(attn, h, w):
        return draft_mlp_block_unfused(attn, h, w, eps)
    from gemma4_spec.ops.draft_mlp_block_triton import draft_mlp_block_kernel

    return draft_mlp_block_kernel(attn, h, w, eps)


def uses_draft_block(
    device: torch.device | str | None, tp_size: int, activation: str, biased: bool
) -> bool:
    """Whether the assistant's layers run through ``draft_mlp_block``: asked for
    (``GEMMA4_SPEC_DRAFT_BLOCK=1``), on CUDA with Triton, one tensor-parallel rank (the
    kernel's projections are whole, no all-reduce), the kernel's activation, no biases."""
    if device is None or not turned_on(DRAFT_BLOCK_ENV):
        return False
    device = torch.device(device)
    return (
        device.type == "cuda"
        and triton_usable(device)
        and tp_size == 1
        and activation == FUSED_ACTIVATION
        and not biased
    )
