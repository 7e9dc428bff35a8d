"""The Triton kernel of ``small_linear``: ``x [T, K] @ weight [N, K]^T`` for T of a few rows.

``_small_linear_kernel``, grid ``(tiles x splits,)``: a tile is ``BLOCK_N`` output columns by
``BLOCK_T`` rows; program ``(tile, s)`` computes it over the ``s``-th contiguous run of
``TILES_PER_SPLIT`` steps of ``BLOCK_K`` along K, as ``W [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K,
BLOCK_T]`` with ``tl.dot`` (the weight's rows are the MMA's M side, so one row of x still fills
it; rows past T are masked to zero). With one split the program writes its tile. With several
(a long K over few tiles: the down and output projections, K = 1024-3072 into N = 256, and the
pre-projection) each writes its float32 partial to scratch, and the program that brings a
tile's last partial (an atomic counter per tile) sums the tile's partials in split order (so
the result does not depend on which program came last), writes the tile and sets the counter
back to zero for the next launch or graph replay: one launch where cuBLAS runs a split-K GEMM
and a reduction kernel.

Sizes (``small_linear_config``): ``BLOCK_T`` the next power of two >= T from 16 (the smallest
``tl.dot`` side) to ``MAX_BLOCK_T``; 16 columns a tile (32 past 4096 columns); 128 of K a step;
splits only for K of 4 steps or more, as many as bring the programs to about one per SM, at
least 2 steps each.

Prologues (``PROLOGUE``, ``Prologue``; defined in ``ops/draft_prologue.py``): the kernel may
compute its input tile instead of reading it, in float32, from a draft layer's elementwise step
(an RMS norm; a residual add through a norm, scaled, then a norm; a gated GELU), rounding to the
input's dtype where the torch composition does, and cast to the weight's dtype for ``tl.dot`` as
a plain input is. The norms need whole rows. Up to ``WHOLE_ROW_MAX_K`` (the draft's hidden
width is 256) a program takes whole rows in one K step (``whole_row_config``): it requests the
weight tile and every prologue operand at once and takes both norms in registers. Wider rows
are read by steps: every program first sums its rows' squares over the full K, then
normalises each K step it multiplies (three passes over the rows before the first product).
The programs of the first column tile also write ``h`` (the new residual) and, if asked, the
computed input, each over its own K steps. ``_prologue_kernel`` runs the same
prologue helpers alone (for ``F.linear`` past the few-rows limit).

Counters are per device (``prepare_small_linear``, called by the linear method after the
weights load, outside any graph capture). Launches sharing them must not run concurrently on
different streams. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) the kernel runs on
CPU tensors (programs one after another: the last-arriving sum still holds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gemma4_spec.ops.centroid_argmax_triton import (
    HAS_TRITON,
    _capturing,
    _device_sms,
    _dot_precision,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_BLOCK_T = 64
BLOCK_K = 128
MIN_STEPS_PER_SPLIT = 2
INTERPRET_SMS = 4  # "SM count" under the interpreter: several splits in small tests
COUNTER_CAPACITY = 4096  # tiles of a split launch; splits run only below one tile per SM
# What the kernel computes its input from (``Prologue.mode``; ops/draft_prologue.py).
PROLOGUE_NONE = 0
PROLOGUE_NORM = 1
PROLOGUE_RESIDUAL_NORM = 2
PROLOGUE_ACT_MUL = 3
PROLOGUE_BLOCK_T = 16  # rows per program of the standalone prologue kernel
# Up to this width a norm prologue reads whole rows in one K step (``whole_row_config``).
WHOLE_ROW_MAX_K = 512


class SmallLinearConfig(NamedTuple):
    """Tile sizes and grid of one launch."""

    block_t: int  # rows per tile, a power of two >= 16
    block_n: int  # output columns per tile, a power of two >= 16
    block_k: int  # K per tl.dot step, a power of two >= 16
    splits: int  # programs per tile, each a contiguous run of K steps; >= 1
    steps_per_split: int
    num_warps: int
    num_stages: int


def small_linear_config(
    rows: int, columns: int, depth: int, device: torch.device
) -> SmallLinearConfig:
    """The sizes ``small_linear_kernel`` launches with for ``[rows, depth] @ [columns, depth]^T``
    (module docstring)."""
    block_t = min(MAX_BLOCK_T, max(16, triton.next_power_of_2(rows)))
    block_k = min(BLOCK_K, max(16, triton.next_power_of_2(depth)))
    block_n = 16 if columns <= 4096 else 32
    sms = _device_sms(device)[0] if device.type == "cuda" else INTERPRET_SMS
    tiles = triton.cdiv(columns, block_n) * triton.cdiv(rows, block_t)
    steps = triton.cdiv(depth, block_k)
    splits = 1
    if steps >= 2 * MIN_STEPS_PER_SPLIT and tiles < sms:
        splits = min(steps // MIN_STEPS_PER_SPLIT, max(1, sms // tiles))
    per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, per_split)  # no split without steps
    return SmallLinearConfig(
        block_t, block_n, block_k, splits, per_split, num_warps=4, num_stages=3
    )


_COUNTERS: dict[str, torch.Tensor] = {}


def prepare_small_linear(device: torch.device | str) -> torch.Tensor:
    """The device's tile counters (zeroed, self-resetting), made on the first call."""
    key = str(torch.device(device))
    counters = _COUNTERS.get(key)
    if counters is None:
        if _capturing(torch.device(device)):
            raise RuntimeError(
                "small_linear: first split launch on this device inside graph capture; "
                "call prepare_small_linear(device) (or one launch) before capturing"
            )
        counters = torch.zeros(COUNTER_CAPACITY, dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


if HAS_TRITON:
    _NORM = tl.constexpr(PROLOGUE_NORM)
    _RESIDUAL_NORM = tl.constexpr(PROLOGUE_RESIDUAL_NORM)
    _ACT_MUL = tl.constexpr(PROLOGUE_ACT_MUL)

    @triton.jit
    def _as_dtype_of(v, ptr):
        """float32 ``v`` rounded to nearest (even) in ``ptr``'s element type, back in float32:
        where the torch composition the prologue stands for rounds an intermediate, so does the
        kernel. To bfloat16 by hand (the same bits as CUDA's conversion): Triton's CPU
        interpreter truncates instead."""
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            return (bits & -65536).to(tl.float32, bitcast=True)
        return v.to(ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _inverse_rms(sum_sq, width, eps):
        """``1 / sqrt(mean(v^2) + eps)`` per row, from the rows' float32 sums of squares."""
        return 1.0 / tl.sqrt(sum_sq / width + eps)

    @triton.jit
    def _gelu_tanh(v):
        """GELU with the tanh approximation of float32 ``v``: ``0.5 v (1 + tanh(u))`` with
        ``u = sqrt(2 / pi) (v + 0.044715 v^3)``, written as ``v * sigmoid(2u)`` (the same
        function; Triton has a sigmoid on every backend, a tanh not)."""
        u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        return v * tl.sigmoid(2.0 * u)

    @triton.jit
    def _scaled_by_weight(v, inv_rms, w_ptr, offs_k, k_ok):
        """The tail of an RMS norm on a tile: ``v * inv_rms`` rounded to the weight's dtype,
        times the weight, rounded again (float32 values of that dtype)."""
        w = tl.load(w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        return _as_dtype_of(_as_dtype_of(v * inv_rms[:, None], w_ptr) * w, w_ptr)

    @triton.jit
    def _residual_of(
        a, r, r_rows, w_post_ptr, s_ptr, offs_k, k_ok, inv_a, HAS_SCALAR: tl.constexpr
    ):
        """``h = (r + rmsnorm(a, w_post)) [* s]`` of loaded float32 tiles, each step rounded
        to r's dtype."""
        h = _as_dtype_of(r + _scaled_by_weight(a, inv_a, w_post_ptr, offs_k, k_ok), r_rows)
        if HAS_SCALAR:
            h = _as_dtype_of(h * tl.load(s_ptr).to(tl.float32), r_rows)
        return h

    @triton.jit
    def _residual_tile(
        a_rows, r_rows, w_post_ptr, s_ptr, offs_k, ok, k_ok, inv_a, HAS_SCALAR: tl.constexpr
    ):
        """``h = (r + rmsnorm(a, w_post)) [* s]`` on a tile read from ``a_rows`` / ``r_rows``."""
        a = tl.load(a_rows[:, None] + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        r = tl.load(r_rows[:, None] + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        return _residual_of(a, r, r_rows, w_post_ptr, s_ptr, offs_k, k_ok, inv_a, HAS_SCALAR)

    @triton.jit
    def _whole_rows(
        x_rows, r_rows, w_post_ptr, w_pre_ptr, s_ptr, offs_k, t_ok, K, eps_post, eps_pre,
        PROLOGUE: tl.constexpr, HAS_SCALAR: tl.constexpr,
    ):  # fmt: skip
        """The norms' prologue when one tile holds whole rows (``K <= BLOCK_K``): every
        operand is read once, up front, and both norms are taken in registers (the looped
        prologue reads the rows three times, one pass after another, before its first
        product). Returns the matmul input and, for RESIDUAL_NORM, ``h`` (else the input)."""
        k_ok = offs_k < K
        ok = t_ok[:, None] & k_ok[None, :]
        a = tl.load(x_rows[:, None] + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        if PROLOGUE == _RESIDUAL_NORM:
            r = tl.load(r_rows[:, None] + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
            inv_a = _inverse_rms(tl.sum(a * a, axis=1), K, eps_post)
            h = _residual_of(a, r, r_rows, w_post_ptr, s_ptr, offs_k, k_ok, inv_a, HAS_SCALAR)
        else:
            h = a
        x = _scaled_by_weight(
            h, _inverse_rms(tl.sum(h * h, axis=1), K, eps_pre), w_pre_ptr, offs_k, k_ok
        )
        if PROLOGUE == _NORM:
            h = x
        return x, h

    @triton.jit
    def _dot_step(w, x, acc, w_ptr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """``acc += w @ x^T`` with x cast to the weight's dtype (as a plain input is)."""
        x = x.to(w_ptr.dtype.element_ty)
        if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        return tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)

    @triton.jit
    def _row_scales(
        x_rows, r_rows, w_post_ptr, s_ptr, t_ok, K, eps_post, eps_pre,
        PROLOGUE: tl.constexpr, HAS_SCALAR: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Per row of the tile, the inverse RMS of the post norm's input (RESIDUAL_NORM: a)
        and of the matmul input's norm (NORM: x; RESIDUAL_NORM: h), each over the full width
        ``K`` in steps of ``BLOCK_K`` (the rows are a few KiB: the re-reads hit the cache).
        Zeros, not read, for the other prologues."""
        inv_a = tl.zeros([BLOCK_T], dtype=tl.float32)
        inv_x = inv_a
        if PROLOGUE == _NORM or PROLOGUE == _RESIDUAL_NORM:
            first_eps = eps_pre
            if PROLOGUE == _RESIDUAL_NORM:
                first_eps = eps_post
            sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                ok = t_ok[:, None] & (offs_k < K)[None, :]
                v = tl.load(x_rows[:, None] + offs_k[None, :], mask=ok, other=0.0)
                sum_sq += tl.sum(v.to(tl.float32) * v.to(tl.float32), axis=1)
            inv_a = _inverse_rms(sum_sq, K, first_eps)
            inv_x = inv_a
        if PROLOGUE == _RESIDUAL_NORM:
            sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                ok = t_ok[:, None] & k_ok[None, :]
                h = _residual_tile(
                    x_rows, r_rows, w_post_ptr, s_ptr, offs_k, ok, k_ok, inv_a, HAS_SCALAR
                )
                sum_sq += tl.sum(h * h, axis=1)
            inv_x = _inverse_rms(sum_sq, K, eps_pre)
        return inv_a, inv_x

    @triton.jit
    def _prologue_tile(
        x_rows, r_rows, w_post_ptr, w_pre_ptr, s_ptr, offs_k, t_ok, K, inv_a, inv_x,
        PROLOGUE: tl.constexpr, HAS_SCALAR: tl.constexpr,
    ):  # fmt: skip
        """The matmul input's tile ``[rows, K step]`` (float32 values of the input's dtype)
        and, for RESIDUAL_NORM, the residual ``h``'s (else the input's again)."""
        k_ok = offs_k < K
        ok = t_ok[:, None] & k_ok[None, :]
        if PROLOGUE == _ACT_MUL:
            gate = tl.load(x_rows[:, None] + offs_k[None, :], mask=ok, other=0.0)
            up = tl.load(x_rows[:, None] + K + offs_k[None, :], mask=ok, other=0.0)
            act = _as_dtype_of(_gelu_tanh(gate.to(tl.float32)), x_rows)
            x = _as_dtype_of(act * up.to(tl.float32), x_rows)
            h = x
        elif PROLOGUE == _NORM:
            v = tl.load(x_rows[:, None] + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
            x = _scaled_by_weight(v, inv_x, w_pre_ptr, offs_k, k_ok)
            h = x
        else:
            h = _residual_tile(
                x_rows, r_rows, w_post_ptr, s_ptr, offs_k, ok, k_ok, inv_a, HAS_SCALAR
            )
            x = _scaled_by_weight(h, inv_x, w_pre_ptr, offs_k, k_ok)
        return x, h

    @triton.jit
    def _store_prologue(
        h_ptr, xo_ptr, x, h, offs_t, offs_k, ok, K, WRITE_H: tl.constexpr, WRITE_X: tl.constexpr
    ):
        """Writes the tile's ``h`` and / or input ``x`` to their ``[T, K]`` outputs."""
        at = offs_t[:, None].to(tl.int64) * K + offs_k[None, :]
        if WRITE_H:
            tl.store(h_ptr + at, h.to(h_ptr.dtype.element_ty), mask=ok)
        if WRITE_X:
            tl.store(xo_ptr + at, x.to(xo_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["T"])
    def _small_linear_kernel(
        x_ptr,  # [T, K] ([T, 2K] gate | up for ACT_MUL; a for RESIDUAL_NORM)
        w_ptr,  # [N, K]
        part_ptr,  # [SPLITS, T, N] fp32 scratch (read only with SPLITS > 1)
        counter_ptr,  # [tiles] int32, zero on entry and on exit (SPLITS > 1)
        out_ptr,  # [T, N]
        r_ptr,  # [T, K] residual (RESIDUAL_NORM), rows strided as x's
        w_post_ptr,  # [K] post norm weight (RESIDUAL_NORM)
        w_pre_ptr,  # [K] the matmul input's norm weight (NORM, RESIDUAL_NORM)
        s_ptr,  # [1] scalar (HAS_SCALAR)
        h_ptr,  # [T, K] residual out (WRITE_H)
        xo_ptr,  # [T, K] matmul input out (WRITE_X)
        T,
        N,
        K,
        stride_x,
        stride_w,
        stride_out,
        eps_post,
        eps_pre,
        SPLITS,
        STEPS_PER_SPLIT,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr,  # SPLITS > 1
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        PROLOGUE: tl.constexpr,  # PROLOGUE_NONE: x is read as it is
        HAS_SCALAR: tl.constexpr,
        WRITE_H: tl.constexpr,
        WRITE_X: tl.constexpr,
        WHOLE_ROW: tl.constexpr,  # the norms' prologue over whole rows in one step (K <= BLOCK_K)
    ):
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        tiles = n_tiles * tl.cdiv(T, BLOCK_T)
        tile = pid % tiles  # fastest: the splits of one K run read neighbouring columns
        s = pid // tiles
        offs_n = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_t = (tile // n_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
        n_ok = offs_n < N
        t_ok = offs_t < T
        w_rows = w_ptr + offs_n.to(tl.int64) * stride_w
        x_rows = x_ptr + offs_t.to(tl.int64) * stride_x
        r_rows = r_ptr + offs_t.to(tl.int64) * stride_x
        # The first column tile's programs write h / x, each over its own K steps.
        writes_t = offs_t < tl.where((tile % n_tiles) == 0, T, 0)
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        if WHOLE_ROW:  # one K step of whole rows, the weight tile requested first
            offs_k = tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w = tl.load(
                w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            x, h = _whole_rows(
                x_rows, r_rows, w_post_ptr, w_pre_ptr, s_ptr, offs_k, t_ok, K, eps_post,
                eps_pre, PROLOGUE, HAS_SCALAR,
            )  # fmt: skip
            writes = writes_t[:, None] & k_ok[None, :]
            _store_prologue(h_ptr, xo_ptr, x, h, offs_t, offs_k, writes, K, WRITE_H, WRITE_X)
            acc = _dot_step(w, x, acc, w_ptr, PRECISION, UPCAST)
        else:
            inv_a, inv_x = _row_scales(
                x_rows, r_rows, w_post_ptr, s_ptr, t_ok, K, eps_post, eps_pre, PROLOGUE,
                HAS_SCALAR, BLOCK_T, BLOCK_K,
            )  # fmt: skip
            k_first = s * STEPS_PER_SPLIT * BLOCK_K
            for j in range(0, STEPS_PER_SPLIT):
                offs_k = k_first + j * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                w_ok = n_ok[:, None] & k_ok[None, :]
                x_ok = t_ok[:, None] & k_ok[None, :]
                w = tl.load(w_rows[:, None] + offs_k[None, :], mask=w_ok, other=0.0)
                if PROLOGUE == 0:
                    x = tl.load(x_rows[:, None] + offs_k[None, :], mask=x_ok, other=0.0)
                else:
                    x, h = _prologue_tile(
                        x_rows, r_rows, w_post_ptr, w_pre_ptr, s_ptr, offs_k, t_ok, K, inv_a,
                        inv_x, PROLOGUE, HAS_SCALAR,
                    )  # fmt: skip
                    writes = writes_t[:, None] & k_ok[None, :]
                    _store_prologue(
                        h_ptr, xo_ptr, x, h, offs_t, offs_k, writes, K, WRITE_H, WRITE_X
                    )
                acc = _dot_step(w, x, acc, w_ptr, PRECISION, UPCAST)
        out_at = out_ptr + offs_t[None, :].to(tl.int64) * stride_out + offs_n[:, None]
        out_ok = n_ok[:, None] & t_ok[None, :]
        if SPLIT:
            at = offs_t[None, :] * N + offs_n[:, None]
            tl.store(part_ptr + s * T * N + at, acc, mask=out_ok)
            tl.debug_barrier()  # every thread's stores before the (releasing) counter update
            done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if done == SPLITS - 1:
                # The tile's last partial: sum all of them (written by other programs: read
                # through L2, ".cg") in split order.
                tl.debug_barrier()
                total = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
                for s2 in range(0, SPLITS):
                    total += tl.load(
                        part_ptr + s2 * T * N + at, mask=out_ok, other=0.0, cache_modifier=".cg"
                    )
                tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)
                tl.store(counter_ptr + tile, 0)
        else:
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_ok)

    @triton.jit(do_not_specialize=["T"])
    def _prologue_kernel(
        x_ptr, r_ptr, w_post_ptr, w_pre_ptr, s_ptr, h_ptr, xo_ptr, T, K, stride_x, eps_post,
        eps_pre, STEPS, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr,
        HAS_SCALAR: tl.constexpr, WRITE_H: tl.constexpr, WHOLE_ROW: tl.constexpr,
    ):  # fmt: skip
        """The prologue alone, grid ``(row blocks, K runs)``: program ``(b, c)`` writes the
        matmul input ``x`` (and ``h``) of ``BLOCK_T`` rows over the ``c``-th run of ``STEPS``
        steps of ``BLOCK_K`` (one run of the whole width for the norms, which need whole rows;
        one step of it with ``WHOLE_ROW``)."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        x_rows = x_ptr + offs_t.to(tl.int64) * stride_x
        r_rows = r_ptr + offs_t.to(tl.int64) * stride_x
        if WHOLE_ROW:
            offs_k = tl.arange(0, BLOCK_K)
            x, h = _whole_rows(
                x_rows, r_rows, w_post_ptr, w_pre_ptr, s_ptr, offs_k, t_ok, K, eps_post,
                eps_pre, PROLOGUE, HAS_SCALAR,
            )  # fmt: skip
            ok = t_ok[:, None] & (offs_k < K)[None, :]
            _store_prologue(h_ptr, xo_ptr, x, h, offs_t, offs_k, ok, K, WRITE_H, True)
            return
        inv_a, inv_x = _row_scales(
            x_rows, r_rows, w_post_ptr, s_ptr, t_ok, K, eps_post, eps_pre, PROLOGUE, HAS_SCALAR,
            BLOCK_T, BLOCK_K,
        )  # fmt: skip
        k_first = tl.program_id(1) * STEPS * BLOCK_K
        for j in range(0, STEPS):
            offs_k = k_first + j * BLOCK_K + tl.arange(0, BLOCK_K)
            x, h = _prologue_tile(
                x_rows, r_rows, w_post_ptr, w_pre_ptr, s_ptr, offs_k, t_ok, K, inv_a, inv_x,
                PROLOGUE, HAS_SCALAR,
            )  # fmt: skip
            ok = t_ok[:, None] & (offs_k < K)[None, :]
            _store_prologue(h_ptr, xo_ptr, x, h, offs_t, offs_k, ok, K, WRITE_H, True)


class Prologue(NamedTuple):
    """What the kernel's input is computed from, and what else it writes (the definitions
    are in ops/draft_prologue.py). ``x`` of the launch is then the normed input (NORM), the
    sub-layer output ``a`` (RESIDUAL_NORM) or ``[gate | up]`` (ACT_MUL, K = half its width)."""

    mode: int = PROLOGUE_NONE
    residual: torch.Tensor | None = None  # RESIDUAL_NORM: [T, K], rows strided as x's
    post_weight: torch.Tensor | None = None  # RESIDUAL_NORM: [K], a's norm
    pre_weight: torch.Tensor | None = None  # NORM, RESIDUAL_NORM: [K], the matmul input's norm
    scalar: torch.Tensor | None = None  # RESIDUAL_NORM: [1], h's scale (None: 1)
    eps_post: float = 0.0
    eps_pre: float = 0.0
    write_x: bool = False  # the fused launch also writes the matmul input x


NO_PROLOGUE = Prologue()


def prologue_depth(x: torch.Tensor, mode: int) -> int:
    """K of the matmul whose prologue reads ``x``: half its width for ACT_MUL."""
    return x.shape[1] // 2 if mode == PROLOGUE_ACT_MUL else x.shape[1]


def _prologue_operands(out: torch.Tensor, prologue: Prologue) -> list[torch.Tensor]:
    """The residual, post weight, pre weight and scalar pointers (``out`` where unused)."""
    return [
        out if t is None else t
        for t in (prologue.residual, prologue.post_weight, prologue.pre_weight, prologue.scalar)
    ]


def whole_row_block(depth: int, mode: int) -> int | None:
    """The K step that holds whole rows of a norm prologue's input (a power of two >= 16), or
    None where the prologue reads by steps (no norm, or rows wider than WHOLE_ROW_MAX_K)."""
    block = max(16, triton.next_power_of_2(depth))
    norms = mode in (PROLOGUE_NORM, PROLOGUE_RESIDUAL_NORM)
    return block if norms and block <= WHOLE_ROW_MAX_K else None


def whole_row_config(
    rows: int, columns: int, depth: int, device: torch.device, mode: int
) -> SmallLinearConfig:
    """``small_linear_config``, but for a norm prologue over rows of at most WHOLE_ROW_MAX_K:
    one unsplit K step of whole rows, so every operand is read once (``_whole_rows``); more
    warps for the wider row tiles, which hold several whole-row arrays in registers."""
    cfg = small_linear_config(rows, columns, depth, device)
    block = whole_row_block(depth, mode)
    if block is None:
        return cfg
    warps = 8 if cfg.block_t >= 32 else 4
    return cfg._replace(block_k=block, splits=1, steps_per_split=1, num_warps=warps, num_stages=1)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, config: SmallLinearConfig | None, prologue: Prologue
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One launch of ``_small_linear_kernel``: (out, h or None, x or None)."""
    rows = x.shape[0]
    depth = prologue_depth(x, prologue.mode)
    columns = weight.shape[0]
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    write_h = prologue.mode == PROLOGUE_RESIDUAL_NORM
    h = torch.empty(rows, depth, dtype=x.dtype, device=x.device) if write_h else None
    xo = torch.empty(rows, depth, dtype=x.dtype, device=x.device) if prologue.write_x else None
    if rows == 0:
        return out, h, xo
    cfg = config or whole_row_config(rows, columns, depth, x.device, prologue.mode)
    whole_row = (
        whole_row_block(depth, prologue.mode) is not None
        and cfg.splits == 1
        and cfg.block_k >= depth
    )
    tiles = triton.cdiv(columns, cfg.block_n) * triton.cdiv(rows, cfg.block_t)
    split = cfg.splits > 1
    if split:
        if tiles > COUNTER_CAPACITY:
            raise ValueError(f"small_linear: {tiles} tiles of a split launch exceed the counters")
        counters = prepare_small_linear(x.device)
        part = torch.empty(cfg.splits, rows, columns, dtype=torch.float32, device=x.device)
    else:
        counters = part = out  # not read
    precision, upcast = _dot_precision(x)
    _small_linear_kernel[(tiles * cfg.splits,)](
        x, weight, part, counters, out, *_prologue_operands(out, prologue),
        out if h is None else h, out if xo is None else xo, rows, columns, depth, x.stride(0),
        weight.stride(0), out.stride(0), prologue.eps_post, prologue.eps_pre, cfg.splits,
        cfg.steps_per_split, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=split, PRECISION=precision, UPCAST=upcast, PROLOGUE=prologue.mode,
        HAS_SCALAR=prologue.scalar is not None, WRITE_H=write_h, WRITE_X=prologue.write_x,
        WHOLE_ROW=whole_row, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, h, xo


def small_linear_kernel(
    x: torch.Tensor, weight: torch.Tensor, config: SmallLinearConfig | None = None
) -> torch.Tensor:
    """``x [T, K] @ weight [N, K]^T`` in ``x``'s dtype, in one launch. ``x`` and ``weight`` must
    be contiguous along K (``small_linear`` checks and falls back before calling this)."""
    return _launch(x, weight, config, NO_PROLOGUE)[0]


def prologue_linear_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    prologue: Prologue,
    config: SmallLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``prologue(x) @ weight^T`` in one launch: (out, h for RESIDUAL_NORM else None, the
    matmul input if ``prologue.write_x`` else None). Rows of ``x`` (and the residual) must be
    contiguous along K, as must the weight's and the norm weights."""
    return _launch(x, weight, config, prologue)


def prologue_kernel(
    x: torch.Tensor, prologue: Prologue
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prologue alone, in one launch: (the matmul input ``[T, K]``, h for RESIDUAL_NORM
    else None), for a matmul by ``F.linear`` where the few-rows kernel does not apply."""
    rows = x.shape[0]
    depth = prologue_depth(x, prologue.mode)
    xo = torch.empty(rows, depth, dtype=x.dtype, device=x.device)
    write_h = prologue.mode == PROLOGUE_RESIDUAL_NORM
    h = torch.empty(rows, depth, dtype=x.dtype, device=x.device) if write_h else None
    if rows == 0:
        return xo, h
    whole = whole_row_block(depth, prologue.mode)
    block_k = whole or min(BLOCK_K, max(16, triton.next_power_of_2(depth)))
    steps = triton.cdiv(depth, block_k)
    # Elementwise (ACT_MUL): a program per step; the norms need whole rows: one per row block.
    runs, per_run = (steps, 1) if prologue.mode == PROLOGUE_ACT_MUL else (1, steps)
    grid = (triton.cdiv(rows, PROLOGUE_BLOCK_T), runs)
    _prologue_kernel[grid](
        x, *_prologue_operands(xo, prologue), xo if h is None else h, xo, rows, depth,
        x.stride(0), prologue.eps_post, prologue.eps_pre, per_run, BLOCK_T=PROLOGUE_BLOCK_T,
        BLOCK_K=block_k, PROLOGUE=prologue.mode, HAS_SCALAR=prologue.scalar is not None,
        WRITE_H=write_h, WHOLE_ROW=whole is not None, num_warps=4,
    )  # fmt: skip
    return xo, h
