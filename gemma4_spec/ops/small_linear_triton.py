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
least 2 steps each. ``target_config``: the same with 64 columns a tile and 4 stages, for the
target's wide weights.

``GATED`` (``small_linear_gelu_and_mul_kernel``, one split only): ``weight`` stacks the gate's
and the up projection's rows (``[2N, K]``, as vLLM's merged gate/up layer holds them); a program
accumulates its columns of both and writes ``gelu_tanh(gate) * up`` (each product rounded to
the output dtype first, as the matmul's output would be), where the draft's MLP would launch a
second kernel for the activation.

Counters are per device (``prepare_small_linear``, called by the linear method after the
weights load, outside any graph capture). Launches sharing them must not run concurrently on
different streams. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) the kernel runs on
CPU tensors (programs one after another: the last-arriving sum still holds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, _dot_precision, sm_count
from gemma4_spec.ops.device_counters import device_counters

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_BLOCK_T = 64
BLOCK_K = 128
MIN_STEPS_PER_SPLIT = 2
INTERPRET_SMS = 4  # "SM count" under the interpreter: several splits in small tests
COUNTER_CAPACITY = 4096  # tiles of a split launch; splits run only below one tile per SM


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
    block_n = 16 if columns <= 4096 else 32
    return _with_splits(rows, columns, depth, device, block_n, num_stages=3)


def target_config(rows: int, columns: int, depth: int, device: torch.device) -> SmallLinearConfig:
    """The sizes for the target's matmuls (``target_linear``): weights of 0.8-75 MB read once
    at a few rows, where the draft's narrow tiles re-read the rows more than the weight: 64
    columns a tile, 4 stages (the fastest in the H100 sweep of the target's shapes, 278d557);
    splits over K by the same rule (the down projections' few column tiles)."""
    return _with_splits(rows, columns, depth, device, block_n=64, num_stages=4)


def _with_splits(
    rows: int, columns: int, depth: int, device: torch.device, block_n: int, num_stages: int
) -> SmallLinearConfig:
    """One row tile up to ``MAX_BLOCK_T`` rows, ``BLOCK_K`` of K a step, and splits over K
    where the tiles leave SMs idle (module docstring)."""
    block_t = row_block(rows)
    block_k = min(BLOCK_K, max(16, triton.next_power_of_2(depth)))
    tiles = triton.cdiv(columns, block_n) * triton.cdiv(rows, block_t)
    splits, per_split = k_splits(triton.cdiv(depth, block_k), tiles, device)
    return SmallLinearConfig(
        block_t, block_n, block_k, splits, per_split, num_warps=4, num_stages=num_stages
    )


def row_block(rows: int) -> int:
    """The row tile for ``rows`` rows: the next power of two from 16 (``tl.dot``'s smallest
    side) to ``MAX_BLOCK_T``."""
    return min(MAX_BLOCK_T, max(16, triton.next_power_of_2(rows)))


def k_splits(steps: int, tiles: int, device: torch.device) -> tuple[int, int]:
    """``(splits, steps per split)`` for ``steps`` steps along K over ``tiles`` output tiles:
    splits only for 4 steps or more, as many as bring the programs to about one per SM, at
    least ``MIN_STEPS_PER_SPLIT`` steps each."""
    sms = sm_count(device, INTERPRET_SMS)
    splits = 1
    if steps >= 2 * MIN_STEPS_PER_SPLIT and tiles < sms:
        splits = min(steps // MIN_STEPS_PER_SPLIT, max(1, sms // tiles))
    per_split = triton.cdiv(steps, splits)
    return triton.cdiv(steps, per_split), per_split  # no split without steps


def prepare_small_linear(device: torch.device | str) -> torch.Tensor:
    """The device's tile counters (zeroed, self-resetting), made on the first call."""
    return device_counters("small_linear", device, COUNTER_CAPACITY)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["T"])
    def _small_linear_kernel(
        x_ptr,  # [T, K]
        w_ptr,  # [N, K]
        part_ptr,  # [SPLITS, T, N] fp32 scratch (read only with SPLITS > 1)
        counter_ptr,  # [tiles] int32, zero on entry and on exit (SPLITS > 1)
        out_ptr,  # [T, N]
        T,
        N,
        K,
        stride_x,
        stride_w,
        stride_out,
        SPLITS,
        STEPS_PER_SPLIT,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr,  # SPLITS > 1
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        GATED: tl.constexpr = False,  # w is [2N, K]: write gelu_tanh(x @ w[:N]^T) * x @ w[N:]^T
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
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)  # GATED: the up columns
        k_first = s * STEPS_PER_SPLIT * BLOCK_K
        for j in range(0, STEPS_PER_SPLIT):
            offs_k = k_first + j * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w_ok = n_ok[:, None] & k_ok[None, :]
            x_ok = t_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows[:, None] + offs_k[None, :], mask=w_ok, other=0.0)
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=x_ok, other=0.0)
            if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
            if GATED:
                u = tl.load(w_rows[:, None] + N * stride_w + offs_k[None, :], mask=w_ok, other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                acc_up = tl.dot(u, tl.trans(x), acc_up, input_precision=PRECISION)
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
        elif GATED:
            dtype = out_ptr.dtype.element_ty
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            tl.store(out_at, (_gelu_tanh(gate) * up).to(dtype), mask=out_ok)
        else:
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _gelu_tanh(x):
        """GELU's tanh form, ``0.5 x (1 + tanh(z))`` with ``z = sqrt(2 / pi) (x + 0.044715
        x^3)``, in float32, as ``x / (1 + exp(-2z))`` (the same value, without the cancellation
        of ``1 + tanh`` for negative ``z``; Triton's interpreter has no libdevice tanh)."""
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(-2.0 * z))


def gated_fits(rows: int, columns: int, depth: int, device: torch.device) -> bool:
    """Whether ``small_linear_gelu_and_mul_kernel`` runs ``[rows, depth]`` by a stacked
    ``[2 columns, depth]`` weight in one split (the gated form writes no partials)."""
    return small_linear_config(rows, columns, depth, device).splits == 1


def small_linear_gelu_and_mul_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ gate^T) * (x @ up^T)`` for ``weight = [gate; up]`` (``[2N, K]``), in
    ``x``'s dtype, in one launch (module docstring; ``gated_fits`` must hold)."""
    return small_linear_kernel(x, weight, gated=True)


def small_linear_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: SmallLinearConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """``x [T, K] @ weight [N, K]^T`` in ``x``'s dtype, in one launch. ``x`` and ``weight`` must
    be contiguous along K (``small_linear`` checks and falls back before calling this).
    ``gated``: ``small_linear_gelu_and_mul_kernel``'s product."""
    rows, depth = x.shape
    columns = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    cfg = config or small_linear_config(rows, columns, depth, x.device)
    tiles = triton.cdiv(columns, cfg.block_n) * triton.cdiv(rows, cfg.block_t)
    split = cfg.splits > 1
    if gated and split:
        raise ValueError("small_linear: the gated form runs in one split (gated_fits)")
    if split:
        if tiles > COUNTER_CAPACITY:
            raise ValueError(f"small_linear: {tiles} tiles of a split launch exceed the counters")
        counters = prepare_small_linear(x.device)
        part = torch.empty(cfg.splits, rows, columns, dtype=torch.float32, device=x.device)
    else:
        counters = part = out  # not read
    precision, upcast = _dot_precision(x)
    _small_linear_kernel[(tiles * cfg.splits,)](
        x, weight, part, counters, out, rows, columns, depth, x.stride(0), weight.stride(0),
        out.stride(0), cfg.splits, cfg.steps_per_split, BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, PRECISION=precision,
        UPCAST=upcast, GATED=gated, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
