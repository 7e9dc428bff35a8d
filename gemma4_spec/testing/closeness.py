"""How close a draft kernel's output must be to its torch reference: one rule per kernel family,
shared by the kernels' tests (which assert it) and their benchmarks (which print it as ``ok``).

Each function returns how far the worst value goes past its allowance (``<= 0``: within). A
kernel sums in another order than torch, and may contract products into fused multiply-adds, so
its float32 sums differ from the reference's in the last bits, and a value rounded to a narrower
dtype may land one rounding step away.
"""

from __future__ import annotations

import torch

FLOAT32_TOLERANCE = 1e-5  # relative (and, for the plain products, absolute) in float32


def _eps(dtype: torch.dtype, steps: int) -> float:
    return FLOAT32_TOLERANCE if dtype == torch.float32 else steps * torch.finfo(dtype).eps


def one_rounding_excess(out: torch.Tensor, ref: torch.Tensor) -> float:
    """A plain product (``small_linear``): each value within one rounding step of the
    reference's at its magnitude (float32: ``FLOAT32_TOLERANCE``, relative and absolute)."""
    diff = (out.float() - ref.float()).abs()
    size = ref.float().abs()
    if out.dtype == torch.float32:
        allowed = FLOAT32_TOLERANCE + FLOAT32_TOLERANCE * size
    else:
        allowed = torch.finfo(out.dtype).eps * size + 1e-6
    return (diff - allowed).max().item()


def reordered_sum_excess(
    out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> float:
    """A plain product over a long K (``target_linear``, K up to 12288): within one rounding of
    the value plus what reordering its K float32 products may move it, taken as 4 sqrt(K) float32
    roundings of the sum of their magnitudes (a sum of K roundings of random sign grows as
    sqrt(K)). Near zero, where the products cancel, one rounding of the value is not enough;
    a lost or doubled block of K (a kernel's error) is still many times the allowance."""
    k = x.shape[-1]
    magnitude = x.float().abs() @ weight.float().abs().t()
    allowed = torch.finfo(out.dtype).eps * ref.float().abs()
    allowed = allowed + 4 * k**0.5 * torch.finfo(torch.float32).eps * magnitude
    return ((out.float() - ref.float()).abs() - allowed).max().item()


def largest_value_excess(out: torch.Tensor, ref: torch.Tensor) -> float:
    """A product then an activation (the gated ``small_linear_gelu_and_mul``): within two
    rounding steps of the value and of the largest value, since the activation carries the
    products' rounding into values near zero."""
    eps = _eps(out.dtype, 2)
    size = ref.float().abs()
    return ((out.float() - ref.float()).abs() - eps * size - eps * size.max()).max().item()


def per_head_excess(out: torch.Tensor, ref: torch.Tensor, head_dim: int) -> float:
    """A norm then a rotation per attention head (``q_norm_rope``): within two rounding steps of
    the head's largest value (the norm's rounding moves into the rotated pairs)."""
    heads = ref.float().view(ref.shape[0], -1, head_dim)
    scale = heads.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    diff = (out.float().view_as(heads) - heads).abs()
    return (diff - _eps(out.dtype, 2) * scale).max().item()
