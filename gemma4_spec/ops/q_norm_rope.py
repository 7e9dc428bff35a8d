"""The draft attention's query norm and rotary embedding in one launch.

Each assistant layer turns its query projection into attention queries in two steps: an RMS norm
over every head (``q_norm``) and vLLM's neox-style rotary embedding at the request's position.
Compiled, they are two Inductor kernels (a reduction for each head's RMS, then a pointwise
kernel for the scale and the rotation), ~1.2-1.4 us each in a draft step's graph on the H100,
where the step is a chain of ~50 small dependent launches. ``ops/q_norm_rope_triton.py`` does
both in one program per (row, head).

``q_norm_rope_reference`` defines it: per head, ``x * rsqrt(mean(x^2) + eps) * weight`` in
float32, rounded to the query's dtype (the norm's output), then rotated in float32 by the
``cos`` / ``sin`` of ``cos_sin_cache[position]`` (``[cos | sin]``, ``rotary_dim / 2`` each; the
first ``rotary_dim`` values of a head are rotated as two halves, the rest pass through, as vLLM's
``RotaryEmbedding`` with ``is_neox_style``) and rounded once more. vLLM's eager modules round in
other places (the norm before its weight, the rotation after each product); the difference is
a rounding step of the draft's queries, which can only change a draft token whose logits tie
within it, and the target verifies every draft.

``q_norm_rope`` (custom op ``gemma4_spec::q_norm_rope``, opaque to torch.compile) runs the
kernel on CUDA (or Triton's CPU interpreter) and the reference elsewhere. The assistant uses it
on CUDA (``fuses_q_rope``) unless ``GEMMA4_SPEC_FUSED_QROPE=0``.
"""

from __future__ import annotations

import torch
from torch import nn

from gemma4_spec.ops.centroid_argmax_triton import triton_usable
from gemma4_spec.ops.custom_ops import custom_op
from gemma4_spec.switches import turned_off

FUSED_QROPE_ENV = "GEMMA4_SPEC_FUSED_QROPE"
Q_NORM_ROPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def q_norm_rope_reference(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    head_dim: int,
) -> torch.Tensor:
    """``q [T, heads * head_dim]`` normed per head and rotated at ``positions [T]`` by
    definition (module docstring)."""
    rows = q.shape[0]
    x = q.float().view(rows, -1, head_dim)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    x = x.to(q.dtype).float()
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).split(half, dim=-1)
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
    return rotated.to(q.dtype).view(rows, -1)


def q_norm_rope_applies(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    head_dim: int,
) -> bool:
    """Whether ``q_norm_rope`` runs the kernel for these operands (else the reference)."""
    rotary = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    return (
        triton_usable(q.device)
        and q.dim() == 2
        and q.dtype in Q_NORM_ROPE_DTYPES
        and q.stride(-1) == 1
        and head_dim > 0
        and q.shape[1] % head_dim == 0
        and weight.shape == (head_dim,)
        and weight.is_contiguous()
        and 0 < rotary <= head_dim
        and rotary % 2 == 0
        and cos_sin_cache.stride(-1) == 1
        and cos_sin_cache.device == q.device
        and positions.shape == (q.shape[0],)
        and positions.is_contiguous()
    )


def _q_like(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    head_dim: int,
) -> torch.Tensor:
    """What ``q_norm_rope`` returns, for torch.compile's tracing."""
    return torch.empty_like(q)


@custom_op("q_norm_rope", fake=_q_like)
def q_norm_rope(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    head_dim: int,
) -> torch.Tensor:
    """The query norm and rotary embedding of ``q [T, heads * head_dim]`` (module docstring):
    one Triton launch, or the reference where the kernel does not apply."""
    if not q_norm_rope_applies(q, weight, cos_sin_cache, positions, head_dim):
        return q_norm_rope_reference(q, weight, cos_sin_cache, positions, eps, head_dim)
    from gemma4_spec.ops.q_norm_rope_triton import q_norm_rope_kernel

    return q_norm_rope_kernel(q, weight, cos_sin_cache, positions, eps, head_dim)


def fuses_q_rope(rotary_emb: nn.Module, device: torch.device | str | None) -> bool:
    """Whether an assistant layer runs its query norm and ``rotary_emb`` as ``q_norm_rope``:
    on CUDA unless ``GEMMA4_SPEC_FUSED_QROPE=0``, for a neox-style rotary embedding whose cache is
    ``[positions, rotary_dim]`` (vLLM's ``RotaryEmbedding`` and Gemma 4's proportional one)."""
    if device is None or turned_off(FUSED_QROPE_ENV):
        return False
    device = torch.device(device)
    cache = getattr(rotary_emb, "cos_sin_cache", None)
    return (
        device.type == "cuda"
        and triton_usable(device)
        and getattr(rotary_emb, "is_neox_style", False) is True
        and isinstance(cache, torch.Tensor)
        and cache.dim() == 2
        and cache.shape[-1] == getattr(rotary_emb, "rotary_dim", -1)
    )
