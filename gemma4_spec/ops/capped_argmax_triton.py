"""Triton kernels of ``capped_argmax.py``: soft-cap and argmax in one read of the logits.

``_split_best_kernel``, grid ``(rows, splits)``: program ``(r, s)`` reads the ``s``-th
contiguous chunk of row ``r`` in tiles of ``BLOCK`` values (``TILES`` of them loaded an
iteration); a tile that raises the chunk's raw
maximum is capped in registers (``_soft_cap``: torch's ``x * (1 / cap)``, ``tanh``, ``* cap`` in
float32, each result rounded to the logits' dtype as torch rounds it) and may replace the
chunk's best (capped value, first id); the others cannot, and are only read. The best goes to
``[rows, splits]`` scratch. ``_reduce_splits_kernel``,
grid ``(rows,)``, takes each row's best over its splits (splits ascend with ids, so the smallest
id among equal maxima is ``argmax``'s first maximal index). Splits are chosen so that about
``PROGRAMS_PER_SM`` programs per SM run (a few rows still fill the GPU) and each reads at least
one tile. ``_soft_cap_values_kernel`` writes ``_soft_cap`` of every value: what
``cap_is_exact`` compares with torch.
"""

from __future__ import annotations

import numpy as np
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, _interpreting, sm_count

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice  # CUDA only (triton_usable), as torch

    from gemma4_spec.ops.centroid_argmax_triton import _best_of

PROGRAMS_PER_SM = 4
BLOCK = 2048  # values per tile: 4 KiB of bfloat16 per load
NUM_WARPS = 8
TILES = 1  # tiles a program loads an iteration (2: two loads in flight; --sweep times both)
MAX_SPLITS = 64  # a power of two: the reduction reads this many partials, masked
INTERPRET_SMS = 4  # "SM count" under Triton's CPU interpreter: a few splits in small tests


def inverse_cap(cap: float) -> float:
    """The multiplier torch divides by a Python scalar with: float32 ``1 / float32(cap)``."""
    return float(np.float32(1.0) / np.float32(cap))


if HAS_TRITON:

    @triton.jit
    def _soft_cap(x, inv_cap, cap, HAS_CAP: tl.constexpr, LIBDEVICE: tl.constexpr):
        """``x`` capped as vLLM's three torch operations cap it, as float32, ``-inf`` (a
        suppressed token) kept. ``tanh`` is CUDA's (libdevice), as torch's is; Triton's CPU
        interpreter has no libdevice, and gets a formula that ``cap_is_exact`` then finds
        inexact."""
        raw = x.to(tl.float32)
        y = raw
        if HAS_CAP:
            dtype = x.dtype
            y = (y * inv_cap).to(dtype).to(tl.float32)
            if LIBDEVICE:
                y = libdevice.tanh(y)
            else:
                y = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)
            y = y.to(dtype).to(tl.float32)
            y = (y * cap).to(dtype).to(tl.float32)
            y = tl.where(raw == float("-inf"), raw, y)
        return y

    @triton.jit
    def _soft_cap_values_kernel(
        x_ptr, out_ptr, n, inv_cap, cap, BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok)
        y = _soft_cap(x, inv_cap, cap, True, LIBDEVICE)
        tl.store(out_ptr + offs, y.to(x.dtype), mask=ok)

    @triton.jit
    def _take_tile(
        x, ids, ok, best_c, best_i, top_raw, V, inv_cap, cap,
        HAS_CAP: tl.constexpr, LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        """A chunk's (best capped value, its first id, largest raw value) after one more tile
        of its values ``x`` at ``ids`` (``ok``: inside the chunk)."""
        tile_top = tl.max(x.to(tl.float32), axis=0)
        if tile_top > top_raw:
            y = tl.where(ok, _soft_cap(x, inv_cap, cap, HAS_CAP, LIBDEVICE), float("-inf"))
            c, i = _best_of(y, tl.where(ok, ids, V), 0, V)
            if c > best_c:  # strict: an equal value keeps the earlier id
                best_c = c
                best_i = i
            top_raw = tile_top
        return best_c, best_i, top_raw

    @triton.jit(do_not_specialize=["V", "stride_row", "chunk", "splits"])
    def _split_best_kernel(
        logits_ptr,  # [rows, V], unit stride along V
        part_val_ptr,  # [rows, splits] fp32
        part_idx_ptr,  # [rows, splits] int32 (V: nothing in the chunk)
        V,
        stride_row,
        chunk,  # values per split, a multiple of BLOCK_V
        splits,
        inv_cap,
        cap,
        HAS_CAP: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK_V: tl.constexpr,
        TILES: tl.constexpr = 1,  # tiles loaded an iteration: 1 or 2
    ):
        r = tl.program_id(0)
        s = tl.program_id(1)
        row = logits_ptr + r.to(tl.int64) * stride_row
        # The chunk's best capped value, its first id, and the largest raw value read so far.
        # The cap is non-decreasing, so a tile whose raw values are all at most that largest
        # one holds no capped value above the best (and its ids come later): only tiles that
        # raise the raw maximum are capped, a few per chunk for any order of values.
        best_c = float("-inf")
        best_i = V
        top_raw = float("-inf")
        start = s * chunk
        end = tl.minimum(start + chunk, V)
        for off in range(start, end, BLOCK_V * TILES):
            # TILES tiles loaded before either is looked at: their loads in flight together.
            ids = off + tl.arange(0, BLOCK_V)
            ok = ids < end
            x = tl.load(row + ids, mask=ok, other=float("-inf"))
            if TILES == 2:
                ids2 = ids + BLOCK_V
                ok2 = ids2 < end
                x2 = tl.load(row + ids2, mask=ok2, other=float("-inf"))
            best_c, best_i, top_raw = _take_tile(
                x, ids, ok, best_c, best_i, top_raw, V, inv_cap, cap, HAS_CAP, LIBDEVICE
            )
            if TILES == 2:
                best_c, best_i, top_raw = _take_tile(
                    x2, ids2, ok2, best_c, best_i, top_raw, V, inv_cap, cap, HAS_CAP, LIBDEVICE
                )
        tl.store(part_val_ptr + r * splits + s, best_c)
        tl.store(part_idx_ptr + r * splits + s, best_i)

    @triton.jit(do_not_specialize=["V", "splits"])
    def _reduce_splits_kernel(
        part_val_ptr, part_idx_ptr, out_ptr, V, splits, BLOCK_S: tl.constexpr
    ):
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK_S)
        ok = offs < splits
        vals = tl.load(part_val_ptr + r * splits + offs, mask=ok, other=float("-inf"))
        ids = tl.load(part_idx_ptr + r * splits + offs, mask=ok, other=V)
        _, i = _best_of(vals, ids, 0, V)
        tl.store(out_ptr + r, tl.where(i == V, 0, i).to(tl.int64))  # all -inf: argmax's 0


def split_count(
    rows: int,
    vocab: int,
    device: torch.device,
    programs_per_sm: int = PROGRAMS_PER_SM,
    block: int = BLOCK,
) -> tuple[int, int]:
    """(splits, values per split) for ``rows`` rows of ``vocab`` values (module docstring), at
    ``programs_per_sm`` and tiles of ``block`` values."""
    sms = sm_count(device, INTERPRET_SMS)
    wanted = max(1, min(MAX_SPLITS, -(-programs_per_sm * sms // max(rows, 1))))
    tiles = -(-vocab // block)
    tiles_per_split = -(-tiles // min(wanted, tiles))
    chunk = tiles_per_split * block
    return -(-vocab // chunk), chunk


def capped_argmax_kernel(
    logits: torch.Tensor,
    cap: float | None,
    programs_per_sm: int = PROGRAMS_PER_SM,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
    tiles: int = TILES,
) -> torch.Tensor:
    """``capped_argmax`` on the GPU (or Triton's interpreter): two launches, no host sync.
    ``programs_per_sm``, ``block`` (a power of two), ``num_warps`` and ``tiles`` (loaded an
    iteration, 1 or 2) other than the defaults are for ``benchmarks/capped_argmax.py
    --sweep``."""
    if tiles not in (1, 2):
        raise ValueError(f"capped_argmax_kernel: tiles={tiles}, expected 1 or 2")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    splits, chunk = split_count(rows, vocab, logits.device, programs_per_sm, block)
    part_val = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    has_cap = cap is not None
    inv = inverse_cap(cap) if cap is not None else 1.0
    _split_best_kernel[(rows, splits)](
        logits,
        part_val,
        part_idx,
        vocab,
        logits.stride(0),
        chunk,
        splits,
        inv,
        float(cap) if cap is not None else 1.0,
        HAS_CAP=has_cap,
        LIBDEVICE=not _interpreting(),
        BLOCK_V=block,
        TILES=tiles,
        num_warps=num_warps,
    )
    _reduce_splits_kernel[(rows,)](part_val, part_idx, out, vocab, splits, BLOCK_S=MAX_SPLITS)
    return out


def soft_cap_values(values: torch.Tensor, cap: float) -> torch.Tensor:
    """``_soft_cap`` of every value of a 1-D tensor, in its dtype (the exactness check's)."""
    out = torch.empty_like(values)
    n = values.numel()
    block = 1024
    _soft_cap_values_kernel[(triton.cdiv(n, block),)](
        values, out, n, inverse_cap(cap), float(cap), BLOCK_N=block, LIBDEVICE=not _interpreting()
    )
    return out
