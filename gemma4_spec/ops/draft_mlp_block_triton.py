"""The Triton kernel of ``draft_mlp_block`` (the definition: ``ops/draft_mlp_block.py``).

``_mlp_block_kernel``, grid ``(P,)``: ``P`` programs, all resident at once (at most one per SM;
the launcher sizes the grid so), run five stages in turn, program ``p`` taking each stage's work
items ``p, p + P, ...``:

  0. the output projection: items are (column tile, K split) pairs, ``small_linear``'s tiles
     and splits for its shape; each writes its float32 partial to scratch;
  1. one item per row: the partials summed (in split order), the projection's output rounded
     to the model dtype, its RMS norm added to the residual (``h1``), and ``h1``'s pre-MLP norm
     (``x``), both to scratch in the model dtype;
  2. gate/up and the activation: items are column tiles of the MLP width; each writes
     ``gelu_tanh(gate) * up`` (``small_linear_gelu_and_mul``'s rounding) to scratch;
  3. the down projection, as stage 0;
  4. one item per row: as stage 1 with the post-MLP norm, then the layer scalar and the next
     norm: the outputs ``h2`` and ``x'``.

Between two stages a grid barrier (``centroid_argmax_triton._grid_barrier``: each program
arrives with a releasing atomic and spins on an acquiring one until all ``P`` have); what a
stage reads of an earlier stage's writes it loads through L2 (``.cg``). After the last stage a
finish counter: its last arrival has seen every program pass every barrier and sets all the
counters back to zero for the next launch or graph replay. With ``staged`` (and always under
Triton's CPU interpreter, which runs programs one after another, so a barrier of more than one
program never opens) each stage is a launch of its own and no barrier runs.

``PREFETCH`` (where a program's tiles fit its registers, ``prefetch_fits``): a program loads
its first gate/up tile before the first barrier and its first down tile before the third, whole
along their K runs, so the weights' trip from memory overlaps the barriers (weights do not
depend on the stages before); stages 2 and 3 then take each tile's K run in one ``tl.dot``.

Rows: up to ``MAX_ROWS`` (one row tile of ``tl.dot``). Caveat, as for the centroid kernel's
persistent form: a kernel on another stream holding SMs while this one waits at a barrier would
deadlock it (nothing in a draft step runs beside it), and so would a share of the SMs smaller
than the device's count (CUDA MPS with an SM limit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gemma4_spec.ops.centroid_argmax_triton import (
    HAS_TRITON,
    _dot_precision,
    _interpreting,
    sm_count,
)
from gemma4_spec.ops.device_counters import device_counters
from gemma4_spec.ops.draft_mlp_block import MlpBlockWeights, block_operands_problem
from gemma4_spec.ops.small_linear_triton import (
    BLOCK_K,
    INTERPRET_SMS,
    MAX_BLOCK_T,
    k_splits,
    row_block,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from gemma4_spec.ops.centroid_argmax_triton import _grid_barrier
    from gemma4_spec.ops.small_linear_triton import _gelu_tanh

MAX_ROWS = MAX_BLOCK_T
BLOCK_N = 16  # output columns a tile, as small_linear's for widths up to 4096
MAX_PREFETCH_K = 256  # the longest K run a prefetched weight tile spans (registers)
STAGES = 5
_BARRIERS = STAGES - 1  # counters 0-3: the barriers; 4: the finish counter
COUNTER_OWNER = "draft_mlp_block"


def prepare_draft_mlp_block(device: torch.device | str) -> torch.Tensor:
    """The device's barrier and finish counters (zeroed, self-resetting), made on the first
    call: before any graph capture."""
    return device_counters(COUNTER_OWNER, device, _BARRIERS + 1)


if HAS_TRITON:

    @triton.jit
    def _tile_product(
        x_ptr,
        stride_x,
        w_ptr,
        stride_w,
        T,
        N,
        K,
        tile,
        k_first,
        steps,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        X_FROM_L2: tl.constexpr,  # x was written by this launch: read it through L2
    ):
        """``W[tile columns, k run] @ x[:, k run]^T`` as a float32 ``[BLOCK_N, BLOCK_T]``."""
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_t = tl.arange(0, BLOCK_T)
        n_ok = offs_n < N
        t_ok = offs_t < T
        w_rows = w_ptr + offs_n.to(tl.int64) * stride_w
        x_rows = x_ptr + offs_t.to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for j in range(0, steps):
            offs_k = k_first + j * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w_ok = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows[:, None] + offs_k[None, :], mask=w_ok, other=0.0)
            x_at = x_rows[:, None] + offs_k[None, :]
            x_ok = t_ok[:, None] & k_ok[None, :]
            if X_FROM_L2:
                x = tl.load(x_at, mask=x_ok, other=0.0, cache_modifier=".cg")
            else:
                x = tl.load(x_at, mask=x_ok, other=0.0)
            if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _split_product(
        x_ptr,
        stride_x,
        w_ptr,
        stride_w,
        part_ptr,
        T,
        N,
        K,
        pid,
        P,
        SPLITS,
        STEPS,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        X_FROM_L2: tl.constexpr,
    ):
        """A projection to ``N`` columns as (tile, split) items, each partial to
        ``part[split, row, column]`` in float32."""
        tiles = tl.cdiv(N, BLOCK_N)
        for item in range(pid, tiles * SPLITS, P):
            tile = item % tiles
            s = item // tiles
            acc = _tile_product(
                x_ptr, stride_x, w_ptr, stride_w, T, N, K, tile, s * STEPS * BLOCK_K, STEPS,
                BLOCK_T, BLOCK_N, BLOCK_K, PRECISION, UPCAST, X_FROM_L2,
            )  # fmt: skip
            _store_partial(part_ptr, acc, s, tile, T, N, BLOCK_T, BLOCK_N)

    @triton.jit
    def _store_partial(part_ptr, acc, s, tile, T, N, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        """A (tile, split) item's float32 ``[BLOCK_N, BLOCK_T]`` to ``part[s, row, column]``."""
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_t = tl.arange(0, BLOCK_T)
        ok = (offs_n < N)[:, None] & (offs_t < T)[None, :]
        tl.store(part_ptr + (s * T + offs_t[None, :]) * N + offs_n[:, None], acc, mask=ok)

    @triton.jit
    def _weight_run(w_ptr, stride_w, tile, N, k0, K, BLOCK_N: tl.constexpr, RUN: tl.constexpr):
        """Columns ``tile`` of a weight over ``RUN`` of K from ``k0``: ``[BLOCK_N, RUN]``."""
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, RUN)
        ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        at = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
        return tl.load(at, mask=ok, other=0.0)

    @triton.jit
    def _run_product(
        w,
        x_ptr,
        stride_x,
        T,
        k0,
        K,
        BLOCK_T: tl.constexpr,
        RUN: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """``w [BLOCK_N, RUN] @ x[:, k0:k0 + RUN]^T`` in float32, ``x`` written by this launch
        (read through L2)."""
        offs_t = tl.arange(0, BLOCK_T)
        offs_k = k0 + tl.arange(0, RUN)
        ok = (offs_t < T)[:, None] & (offs_k < K)[None, :]
        at = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
        x = tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
        if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        return tl.dot(w, tl.trans(x), input_precision=PRECISION)

    @triton.jit
    def _rms(v, gain_ptr, offs, ok, H, eps):
        """``v / sqrt(mean(v^2) + eps) * gain`` of one row (zero past ``H``), float32."""
        mean = tl.sum(v * v, axis=0) / H
        gain = tl.load(gain_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        return v * tl.rsqrt(mean + eps) * gain

    @triton.jit
    def _summed_row(part_ptr, r, T, H, SPLITS, offs, ok, dtype, BLOCK_H: tl.constexpr):
        """Row ``r`` of a projection: its partials summed in split order, rounded to ``dtype``."""
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in range(0, SPLITS):
            acc += tl.load(
                part_ptr + (s * T + r) * H + offs, mask=ok, other=0.0, cache_modifier=".cg"
            )
        return acc.to(dtype).to(tl.float32)

    @triton.jit
    def _mlp_block_kernel(
        attn_ptr,  # [T, Q]
        h_ptr,  # [T, H], the residual stream in
        wo_ptr,  # [H, Q]
        wgu_ptr,  # [2W, H]: the gate's rows, then the up projection's
        wd_ptr,  # [H, W]
        post_attn_ptr,  # [H] gains
        pre_ff_ptr,
        post_ff_ptr,
        next_ptr,
        scalar_ptr,  # [1]
        part_ptr,  # [max splits, T, H] float32 scratch
        h1_ptr,  # [T, H] scratch
        x_ptr,  # [T, H] scratch
        m_ptr,  # [T, W] scratch
        h_out_ptr,  # [T, H]
        x_out_ptr,  # [T, H]
        bar_ptr,  # [5] int32: the barriers' counters, then the finish counter
        T,
        H,
        Q,
        W,  # the MLP width
        stride_attn,
        stride_h,
        eps,
        P,
        O_SPLITS,
        O_STEPS,
        D_SPLITS,
        D_STEPS,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        FIRST: tl.constexpr,  # the stages this launch runs, FIRST..LAST
        LAST: tl.constexpr,
        BARRIERS: tl.constexpr,  # grid barriers between the stages (one launch for all)
        PREFETCH: tl.constexpr,  # load stages 2 and 3's first weights before their barriers
        D_RUN: tl.constexpr,  # D_STEPS * BLOCK_K (PREFETCH: the down projection's K run)
    ):
        pid = tl.program_id(0)
        dtype = h_out_ptr.dtype.element_ty
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        if FIRST <= 0 and LAST >= 0:
            _split_product(
                attn_ptr, stride_attn, wo_ptr, Q, part_ptr, T, H, Q, pid, P, O_SPLITS, O_STEPS,
                BLOCK_T, BLOCK_N, BLOCK_K, PRECISION, UPCAST, False,
            )  # fmt: skip
        if PREFETCH and FIRST <= 2 and LAST >= 2:
            # This program's first gate/up tile, whole along K, in flight during the barriers
            # and stage 1 (weights do not depend on them).
            wg0 = _weight_run(wgu_ptr, H, pid, W, 0, H, BLOCK_N, BLOCK_H)
            wu0 = _weight_run(wgu_ptr + W * H, H, pid, W, 0, H, BLOCK_N, BLOCK_H)
        if BARRIERS:
            _grid_barrier(bar_ptr + 0, P)
        if FIRST <= 1 and LAST >= 1:
            for r in range(pid, T, P):
                a = _summed_row(part_ptr, r, T, H, O_SPLITS, offs_h, h_ok, dtype, BLOCK_H)
                h = tl.load(h_ptr + r * stride_h + offs_h, mask=h_ok, other=0.0).to(tl.float32)
                normed = _rms(a, post_attn_ptr, offs_h, h_ok, H, eps).to(dtype).to(tl.float32)
                h1 = (h + normed).to(dtype).to(tl.float32)
                tl.store(h1_ptr + r * H + offs_h, h1.to(dtype), mask=h_ok)
                x = _rms(h1, pre_ff_ptr, offs_h, h_ok, H, eps)
                tl.store(x_ptr + r * H + offs_h, x.to(dtype), mask=h_ok)
        if BARRIERS:
            _grid_barrier(bar_ptr + 1, P)
        if FIRST <= 2 and LAST >= 2:
            for tile in range(pid, tl.cdiv(W, BLOCK_N), P):
                if PREFETCH:
                    if tile == pid:
                        wg = wg0
                        wu = wu0
                    else:
                        wg = _weight_run(wgu_ptr, H, tile, W, 0, H, BLOCK_N, BLOCK_H)
                        wu = _weight_run(wgu_ptr + W * H, H, tile, W, 0, H, BLOCK_N, BLOCK_H)
                    gate = _run_product(wg, x_ptr, H, T, 0, H, BLOCK_T, BLOCK_H, PRECISION, UPCAST)
                    up = _run_product(wu, x_ptr, H, T, 0, H, BLOCK_T, BLOCK_H, PRECISION, UPCAST)
                else:
                    gate = _tile_product(
                        x_ptr, H, wgu_ptr, H, T, W, H, tile, 0, tl.cdiv(H, BLOCK_K),
                        BLOCK_T, BLOCK_N, BLOCK_K, PRECISION, UPCAST, True,
                    )  # fmt: skip
                    up = _tile_product(
                        x_ptr, H, wgu_ptr + W * H, H, T, W, H, tile, 0, tl.cdiv(H, BLOCK_K),
                        BLOCK_T, BLOCK_N, BLOCK_K, PRECISION, UPCAST, True,
                    )  # fmt: skip
                gate = gate.to(dtype).to(tl.float32)
                up = up.to(dtype).to(tl.float32)
                offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                offs_t = tl.arange(0, BLOCK_T)
                ok = (offs_n < W)[:, None] & (offs_t < T)[None, :]
                m = (_gelu_tanh(gate) * up).to(dtype)
                tl.store(m_ptr + offs_t[None, :] * W + offs_n[:, None], m, mask=ok)
        h_tiles = tl.cdiv(H, BLOCK_N)
        if PREFETCH and FIRST <= 3 and LAST >= 3:  # the first down item's weights, as above
            first_k = (pid // h_tiles) * D_RUN
            wd0 = _weight_run(wd_ptr, W, pid % h_tiles, H, first_k, W, BLOCK_N, D_RUN)
        if BARRIERS:
            _grid_barrier(bar_ptr + 2, P)
        if FIRST <= 3 and LAST >= 3:
            if PREFETCH:
                for item in range(pid, h_tiles * D_SPLITS, P):
                    tile = item % h_tiles
                    k0 = (item // h_tiles) * D_RUN
                    if item == pid:
                        wd = wd0
                    else:
                        wd = _weight_run(wd_ptr, W, tile, H, k0, W, BLOCK_N, D_RUN)
                    acc = _run_product(wd, m_ptr, W, T, k0, W, BLOCK_T, D_RUN, PRECISION, UPCAST)
                    _store_partial(part_ptr, acc, item // h_tiles, tile, T, H, BLOCK_T, BLOCK_N)
            else:
                _split_product(
                    m_ptr, W, wd_ptr, W, part_ptr, T, H, W, pid, P, D_SPLITS, D_STEPS,
                    BLOCK_T, BLOCK_N, BLOCK_K, PRECISION, UPCAST, True,
                )  # fmt: skip
        if BARRIERS:
            _grid_barrier(bar_ptr + 3, P)
        if FIRST <= 4 and LAST >= 4:
            scalar = tl.load(scalar_ptr).to(tl.float32)
            for r in range(pid, T, P):
                d = _summed_row(part_ptr, r, T, H, D_SPLITS, offs_h, h_ok, dtype, BLOCK_H)
                h1 = tl.load(
                    h1_ptr + r * H + offs_h, mask=h_ok, other=0.0, cache_modifier=".cg"
                ).to(tl.float32)
                normed = _rms(d, post_ff_ptr, offs_h, h_ok, H, eps).to(dtype).to(tl.float32)
                h2 = (h1 + normed).to(dtype).to(tl.float32)
                h2 = (h2 * scalar).to(dtype).to(tl.float32)
                tl.store(h_out_ptr + r * H + offs_h, h2.to(dtype), mask=h_ok)
                x_next = _rms(h2, next_ptr, offs_h, h_ok, H, eps)
                tl.store(x_out_ptr + r * H + offs_h, x_next.to(dtype), mask=h_ok)
        if BARRIERS:
            tl.debug_barrier()
            done = tl.atomic_add(bar_ptr + 4, 1, sem="acq_rel")
            if done == P - 1:  # every program has passed every barrier
                for b in range(0, 5):
                    tl.store(bar_ptr + b, 0)


class BlockConfig(NamedTuple):
    """Tile sizes, the two projections' K splits and the grid of one block."""

    block_t: int
    o_splits: int
    o_steps: int
    d_splits: int
    d_steps: int
    programs: int


def block_config(
    rows: int, hidden: int, depth: int, width: int, device: torch.device
) -> BlockConfig:
    """The sizes ``draft_mlp_block_kernel`` runs ``[rows, depth]`` attention output with, for
    hidden width ``hidden`` and MLP width ``width``: ``small_linear``'s row tile, column tiles
    and K splits, one ``BLOCK_K``, and as many programs as the largest stage has items, at
    most one per SM."""
    tiles = triton.cdiv(hidden, BLOCK_N)
    o_splits, o_steps = k_splits(triton.cdiv(depth, BLOCK_K), tiles, device)
    d_splits, d_steps = k_splits(triton.cdiv(width, BLOCK_K), tiles, device)
    items = max(tiles * o_splits, tiles * d_splits, triton.cdiv(width, BLOCK_N), rows)
    programs = min(items, sm_count(device, INTERPRET_SMS))
    return BlockConfig(row_block(rows), o_splits, o_steps, d_splits, d_steps, programs)


def prefetch_fits(hidden: int, down_run: int) -> bool:
    """Whether a program can hold its first gate/up tile (``BLOCK_N`` by the hidden width, both
    halves) and down tile (``BLOCK_N`` by its K run) in registers: up to ``MAX_PREFETCH_K``."""
    return triton.next_power_of_2(hidden) <= MAX_PREFETCH_K and down_run <= MAX_PREFETCH_K


def draft_mlp_block_kernel(
    attn: torch.Tensor,
    h: torch.Tensor,
    w: MlpBlockWeights,
    eps: float,
    staged: bool = False,
    programs: int | None = None,
    prefetch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h2, x')`` of ``draft_mlp_block_reference`` in one launch (``staged``: five, without
    barriers; always five under the interpreter unless ``programs`` is 1). Operands contiguous
    along their last dimension, ``T <= MAX_ROWS`` (``block_operands_problem``); ``programs``
    overrides the grid (tests).
    ``prefetch`` (default: where ``prefetch_fits``) loads stages 2 and 3's first weights before
    their barriers."""
    problem = block_operands_problem(attn, h, w)
    if problem is not None:
        raise ValueError(f"draft_mlp_block: {problem}")
    rows, depth = attn.shape
    hidden = h.shape[1]
    width = w.down.shape[1]
    h_out = torch.empty_like(h)
    x_out = torch.empty_like(h)
    if rows == 0:
        return h_out, x_out
    cfg = block_config(rows, hidden, depth, width, attn.device)
    # never more programs than SMs: all of them must be resident for the barriers to open
    p = min(programs or cfg.programs, sm_count(attn.device, INTERPRET_SMS))
    splits = max(cfg.o_splits, cfg.d_splits)
    part = torch.empty(splits, rows, hidden, dtype=torch.float32, device=h.device)
    h1 = torch.empty_like(h)
    x = torch.empty_like(h)
    m = torch.empty(rows, width, dtype=h.dtype, device=h.device)
    counters = prepare_draft_mlp_block(h.device)
    precision, upcast = _dot_precision(h)
    d_run = cfg.d_steps * BLOCK_K
    fits = prefetch_fits(hidden, d_run)
    if prefetch and not fits:
        raise ValueError(f"draft_mlp_block: no prefetch for hidden {hidden}, K run {d_run}")
    prefetch = fits if prefetch is None else prefetch
    launches = (
        [(s, s) for s in range(STAGES)]
        if staged or (_interpreting() and p > 1)
        else [(0, STAGES - 1)]
    )
    for first, last in launches:
        _mlp_block_kernel[(p,)](
            attn, h, w.o_proj, w.gate_up, w.down, w.post_attention_norm,
            w.pre_feedforward_norm, w.post_feedforward_norm, w.next_norm, w.layer_scalar,
            part, h1, x, m, h_out, x_out, counters, rows, hidden, depth, width,
            attn.stride(0), h.stride(0), eps, p, cfg.o_splits, cfg.o_steps, cfg.d_splits,
            cfg.d_steps, BLOCK_T=cfg.block_t, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            BLOCK_H=triton.next_power_of_2(hidden), PRECISION=precision, UPCAST=upcast,
            FIRST=first, LAST=last, BARRIERS=first != last, PREFETCH=prefetch, D_RUN=d_run,
            num_warps=4, num_stages=3,
        )  # fmt: skip
    return h_out, x_out
