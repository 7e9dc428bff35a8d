"""The Triton kernel of ``q_norm_rope_reference`` (``ops/q_norm_rope.py``).

``_q_norm_rope_kernel``, grid ``(T, heads)``: program ``(t, h)`` loads head ``h`` of row ``t``
twice, as itself and as its rotation partner (value ``i`` pairs with ``i + R / 2`` in the first
half of the ``R`` rotated values, with ``i - R / 2`` in the second, and with itself past ``R``:
the second load comes from L1), takes the head's RMS from the first, rounds both normed values
to the query's dtype as the reference does, and rotates them by the position's ``cos`` /
``sin``. One launch where the compiled draft runs a reduction and a pointwise kernel.
"""

from __future__ import annotations

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _q_norm_rope_kernel(
        q_ptr,  # [T, heads * HEAD]
        w_ptr,  # [HEAD]
        cache_ptr,  # [positions, 2 * HALF]: cos | sin
        pos_ptr,  # [T]
        out_ptr,  # [T, heads * HEAD], unit stride
        eps,
        stride_q,
        stride_cache,
        stride_out,
        HEAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        HALF: tl.constexpr,  # rotary_dim / 2
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, HEAD_PAD)
        ok = offs < HEAD
        first = offs < HALF
        rotated = offs < 2 * HALF
        partner = tl.where(first, offs + HALF, tl.where(rotated, offs - HALF, offs))
        row = q_ptr + t * stride_q + h * HEAD
        x = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
        x_partner = tl.load(row + partner, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD + eps)
        dtype = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        normed = (x * rstd * w).to(dtype).to(tl.float32)
        normed_partner = (x_partner * rstd * w_partner).to(dtype).to(tl.float32)
        angle = tl.where(first, offs, offs - HALF)
        cache = cache_ptr + tl.load(pos_ptr + t).to(tl.int64) * stride_cache
        cos = tl.load(cache + angle, mask=ok & rotated, other=1.0).to(tl.float32)
        sin = tl.load(cache + HALF + angle, mask=ok & rotated, other=0.0).to(tl.float32)
        sign = tl.where(first, -1.0, 1.0)
        out = tl.where(rotated, normed * cos + sign * normed_partner * sin, normed)
        tl.store(out_ptr + t * stride_out + h * HEAD + offs, out.to(dtype), mask=ok)


def q_norm_rope_kernel(
    q: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    head_dim: int,
) -> torch.Tensor:
    """``q_norm_rope_reference``'s value in one launch (``q_norm_rope_applies`` must hold)."""
    rows, width = q.shape
    out = torch.empty(rows, width, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    head_pad = triton.next_power_of_2(head_dim)
    _q_norm_rope_kernel[(rows, width // head_dim)](
        q, weight, cos_sin_cache, positions, out, eps, q.stride(0), cos_sin_cache.stride(0),
        out.stride(0), HEAD=head_dim, HEAD_PAD=head_pad, HALF=cos_sin_cache.shape[-1] // 2,
        num_warps=2 if head_pad > 256 else 1,
    )  # fmt: skip
    return out
