"""Fused GPU kernels for the centroid-masked greedy argmax of a Gemma 4 assistant.

``centroid_argmax_fused(mask, hidden, lm_head_weight)`` returns the same draft tokens as
``centroid_argmax_reference`` (see ``centroid_argmax.py`` for the maths), without building the
gathered ``[T, top_k * V / C, d]`` rows or any ``[T, V]`` logits, in a fixed number of kernel
launches with no host synchronisation (CUDA-graph capturable). Two paths:

* **small T** (``path="gather"``), two kernels:
  1. ``_scores_select_kernel``, grid ``(T, C / BLOCK_C)``: fp32 centroid scores; the last
     program to finish for a token picks its ``top_k`` centroids (the ``top_k``-th largest of
     the scores' order-preserving integer keys, found 4 bits per round with 16 thresholds
     counted at once; ties to the smallest centroid index).
  2. ``_gather_argmax_kernel``, grid ``(T, top_k, SPLIT)``: each program reads its share of one
     selected centroid's lm_head rows, dots them with ``h`` in fp32 and keeps the best
     (value, smallest id); the last program of a token reduces the ``top_k * SPLIT`` partials
     and writes the token id (split-K over candidate blocks, so that T=1 uses many SMs).
* **larger T** (``path="dense"``): the same first kernel (writing, per centroid and token, the
  centroid's slot among the token's picks), then ``_dense_argmax_kernel``, grid
  ``(T / BLOCK_T, C)``: a program reads one centroid's ``V / C`` lm_head rows (through
  ``token_ordering``) once for its whole token block and ``tl.dot``s them with the block's
  hidden states, but only if some token of the block picked that centroid; so the lm_head
  traffic is the union of the block's picks (never more than the whole lm_head, and far less
  at small T). Per (token, picked centroid) partial maxima; the program bringing a token's
  ``top_k``-th partial reduces them.

The definition these kernels implement is ``centroid_argmax_fp32_reference``: everything in
float32 from the given (e.g. bfloat16) values, centroid ties to the smallest centroid index,
logit ties to the smallest token id, suppressed tokens never chosen, and a token whose every
candidate is suppressed gets id 0 (what ``argmax`` of an all ``-inf`` row returns). On bfloat16
inputs the kernels sum in a different order than torch, so tokens can differ only where two
logits (or the ``top_k``-th and next centroid scores) are within rounding of each other.

Counters for the "last program reduces" steps are preallocated and reset by the kernels
themselves; call ``prepare_fused_centroid_argmax`` once outside graph capture (the dispatcher
caches it per mask) so no allocation of persistent state happens during capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gemma4_spec.ops.centroid_argmax import CentroidMask, centroid_argmax

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without triton
    HAS_TRITON = False

# At or above this many tokens the dense path is used: the gather path reads top_k * V / C rows
# (2 MiB in bf16 at E2B dims) per token, the dense one each picked centroid's rows once per
# block of up to 64 tokens (the union of the picks, at most the whole lm_head). Tunable with
# GEMMA4_SPEC_DENSE_MIN_TOKENS.
DENSE_MIN_TOKENS = int(os.environ.get("GEMMA4_SPEC_DENSE_MIN_TOKENS", "4"))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``."""
    return HAS_TRITON and (device.type == "cuda" or _interpreting())


# --------------------------------------------------------------------------------------------
# Plain torch references (the definitions)
# --------------------------------------------------------------------------------------------


def select_centroids_reference(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, C]`` bool: each row's ``top_k`` largest scores, ties to the smallest index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    selected = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return selected.scatter_(1, order, True)


def masked_logits_fp32_reference(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> torch.Tensor:
    """Full-vocab float32 logits, ``-inf`` outside the selected centroids and on suppressed
    tokens, computed from the given values upcast to float32."""
    h = hidden.float()
    scores = h @ mask.centroids_weight.float().t()
    selected = select_centroids_reference(scores, mask.top_k)  # [T, C]
    num_centroids = mask.centroids_weight.shape[0]
    vocab = lm_head_weight.shape[0]
    centroid_of = torch.empty(vocab, dtype=torch.long, device=hidden.device)
    centroid_of[mask.token_ordering] = torch.arange(
        num_centroids, device=hidden.device
    ).repeat_interleave(vocab // num_centroids)
    keep = selected[:, centroid_of]  # [T, V]
    if mask.has_suppressed():
        assert mask.suppressed is not None
        keep[:, mask.suppressed] = False
    logits = h @ lm_head_weight.float().t()
    return logits.masked_fill(~keep, float("-inf"))


def centroid_argmax_fp32_reference(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> torch.Tensor:
    """What the fused kernels compute, by definition: ``argmax`` (first maximal index) of
    ``masked_logits_fp32_reference``, int64 ``[T]``."""
    return masked_logits_fp32_reference(hidden, lm_head_weight, mask).argmax(dim=-1)


# --------------------------------------------------------------------------------------------
# Prepared state
# --------------------------------------------------------------------------------------------


@dataclass
class FusedCentroidState:
    """Per-mask tensors the kernels read, built once (outside graph capture)."""

    ordering: torch.Tensor  # [V] int32, token ids grouped by centroid
    centroid_of: torch.Tensor  # [V] int32, inverse: each token's centroid
    suppressed: torch.Tensor  # [V] int8, 1 = never drafted
    counters: torch.Tensor  # [3, capacity] int32, self-resetting "last program" counters
    num_centroids: int
    vocab: int
    top_k: int

    def ensure_capacity(self, num_tokens: int) -> None:
        if num_tokens <= self.counters.shape[1]:
            return
        if self.counters.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"centroid argmax: {num_tokens} tokens exceed the prepared capacity "
                f"{self.counters.shape[1]}; run once with the largest batch before capture"
            )
        self.counters = torch.zeros(
            3, max(num_tokens, 2 * self.counters.shape[1]), dtype=torch.int32,
            device=self.counters.device,
        )  # fmt: skip


def prepare_fused_centroid_argmax(
    mask: CentroidMask, vocab: int, capacity: int = 1024
) -> FusedCentroidState:
    """Builds the kernels' per-mask state (int32 ordering, its inverse, the suppressed flags)."""
    num_centroids = mask.centroids_weight.shape[0]
    if vocab % num_centroids != 0 or mask.token_ordering.numel() != vocab:
        raise ValueError("token_ordering must be a permutation of the vocab, C | V")
    if not 1 <= mask.top_k <= num_centroids:
        raise ValueError(f"top_k={mask.top_k} must be in [1, {num_centroids}]")
    device = mask.centroids_weight.device
    ordering = mask.token_ordering.to(device=device, dtype=torch.int32).contiguous()
    centroid_of = torch.empty(vocab, dtype=torch.int32, device=device)
    centroid_of[ordering.long()] = torch.arange(
        num_centroids, dtype=torch.int32, device=device
    ).repeat_interleave(vocab // num_centroids)
    suppressed = torch.zeros(vocab, dtype=torch.int8, device=device)
    if mask.has_suppressed():
        assert mask.suppressed is not None
        suppressed[mask.suppressed.to(device=device, dtype=torch.long)] = 1
    counters = torch.zeros(3, capacity, dtype=torch.int32, device=device)
    return FusedCentroidState(
        ordering, centroid_of, suppressed, counters, num_centroids, vocab, mask.top_k
    )


# Keyed by the identity and version of the mask's tensors; the entry holds them alive, so an
# id cannot be reused by another tensor while its entry exists.
_STATE_CACHE: dict[tuple, tuple[tuple[torch.Tensor, ...], FusedCentroidState]] = {}


def _state_for(mask: CentroidMask, vocab: int) -> FusedCentroidState:
    sources: tuple[torch.Tensor, ...] = (mask.token_ordering,)
    if mask.suppressed is not None:
        sources += (mask.suppressed,)
    key = (
        tuple((id(x), x._version) for x in sources),
        vocab,
        mask.centroids_weight.shape[0],
        mask.top_k,
        str(mask.centroids_weight.device),
    )
    hit = _STATE_CACHE.get(key)
    if hit is not None:
        return hit[1]
    if len(_STATE_CACHE) >= 8:
        _STATE_CACHE.clear()
    state = prepare_fused_centroid_argmax(mask, vocab)
    _STATE_CACHE[key] = (sources, state)
    return state


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _sortable_key(x):
        """fp32 -> int32 with the same order (for non-NaN values)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def _scores_select_kernel(
        h_ptr,  # [T, D]
        cw_ptr,  # [C, D]
        scores_ptr,  # [T, C] fp32 scratch
        sel_ptr,  # [T, K] int32 out: selected centroid ids (ascending)
        slot_ptr,  # [C, T] int32 out: rank among the selected (ascending id), -1 if not
        counter_ptr,  # [T] int32, zero on entry and on exit
        T,
        C,
        D,
        K,
        stride_h,
        stride_cw,
        BLOCK_C: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_ALL_C: tl.constexpr,
        WRITE_SEL: tl.constexpr,
        WRITE_SLOT: tl.constexpr,
    ):
        t = tl.program_id(0)
        cb = tl.program_id(1)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            hv = tl.load(h_ptr + t * stride_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            w = tl.load(
                cw_ptr + offs_c[:, None] * stride_cw + offs_d[None, :],
                mask=c_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(w * hv[None, :], axis=1)
        tl.store(scores_ptr + t * C + offs_c, acc, mask=c_ok)
        tl.debug_barrier()  # every thread's stores before the (releasing) counter update
        # The last program of this token selects its top-K centroids from all C scores.
        done = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            tl.debug_barrier()
            offs = tl.arange(0, BLOCK_ALL_C)
            ok = offs < C
            s = tl.load(scores_ptr + t * C + offs, mask=ok, other=0.0, cache_modifier=".cg")
            # Unsigned keys in [0, 2**32); padding gets -1 so it never counts.
            u = tl.where(ok, _sortable_key(s).to(tl.int64) + 2**31, -1)
            # The K-th largest key, 4 bits per round: 16 thresholds tested at once, keep the
            # largest one that at least K keys reach (8 rounds instead of 32 bisection steps).
            probe = tl.arange(0, 16).to(tl.int64)
            kth = tl.full([], 0, tl.int64)
            for r in tl.static_range(8):
                x = kth + (probe << (28 - 4 * r))
                cnt = tl.sum((u[None, :] >= x[:, None]).to(tl.int32), axis=1)
                kth += (tl.sum((cnt >= K).to(tl.int64), axis=0) - 1) << (28 - 4 * r)
            above = u > kth
            need = K - tl.sum(above.to(tl.int32), axis=0)
            equal = (u == kth) & ok
            eq_i = equal.to(tl.int32)
            eq_before = tl.cumsum(eq_i, axis=0) - eq_i
            chosen = ok & (above | (equal & (eq_before < need)))
            ch_i = chosen.to(tl.int32)
            pos = tl.cumsum(ch_i, axis=0) - ch_i
            if WRITE_SEL:
                tl.store(sel_ptr + t * K + pos, offs, mask=chosen)
            if WRITE_SLOT:  # [C, T]: each centroid's slot among the token's picks, or -1
                tl.store(slot_ptr + offs * T + t, tl.where(chosen, pos, -1), mask=ok)
            tl.store(counter_ptr + t, 0)

    @triton.jit
    def _best_of(vals, ids, axis: tl.constexpr, SENTINEL: tl.constexpr):
        """Max value along ``axis`` and the smallest id reaching it (SENTINEL if none valid)."""
        m = tl.max(vals, axis=axis)
        if axis == 0:
            hit = (vals == m) & (ids < SENTINEL)
        else:
            hit = (vals == m[:, None]) & (ids < SENTINEL)
        i = tl.min(tl.where(hit, ids, SENTINEL), axis=axis)
        return m, i

    @triton.jit
    def _gather_argmax_kernel(
        h_ptr,  # [T, D]
        w_ptr,  # [V, D] lm_head
        ordering_ptr,  # [V] int32
        sel_ptr,  # [T, K] int32
        sup_ptr,  # [V] int8
        part_val_ptr,  # [T, K * SPLIT] fp32
        part_idx_ptr,  # [T, K * SPLIT] int32
        counter_ptr,  # [T] int32
        out_ptr,  # [T] int64
        D,
        K,
        TPC,
        stride_h,
        stride_w,
        SPLIT: tl.constexpr,
        ROWS: tl.constexpr,  # rows of one centroid per program: TPC / SPLIT (rounded up)
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,  # >= K * SPLIT
        V: tl.constexpr,
    ):
        t = tl.program_id(0)
        r = tl.program_id(1)
        s = tl.program_id(2)
        c = tl.load(sel_ptr + t * K + r)
        best_v = tl.full([BLOCK_R], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK_R], V, tl.int32)
        for r0 in range(0, ROWS, BLOCK_R):
            local = s * ROWS + r0 + tl.arange(0, BLOCK_R)
            r_ok = (local < TPC) & (r0 + tl.arange(0, BLOCK_R) < ROWS)
            ids = tl.load(ordering_ptr + c * TPC + local, mask=r_ok, other=0)
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                d_ok = offs_d < D
                hv = tl.load(h_ptr + t * stride_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                w = tl.load(
                    w_ptr + ids[:, None].to(tl.int64) * stride_w + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(w * hv[None, :], axis=1)
            sup = tl.load(sup_ptr + ids, mask=r_ok, other=1)
            ok = r_ok & (sup == 0)
            take = ok & ((acc > best_v) | ((acc == best_v) & (ids < best_i)))
            best_v = tl.where(take, acc, best_v)
            best_i = tl.where(take, ids, best_i)
        m, i = _best_of(best_v, best_i, 0, V)
        slot = r * SPLIT + s
        tl.store(part_val_ptr + t * (K * SPLIT) + slot, m)
        tl.store(part_idx_ptr + t * (K * SPLIT) + slot, i)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel")
        if done == K * SPLIT - 1:
            tl.debug_barrier()
            offs = tl.arange(0, BLOCK_P)
            p_ok = offs < K * SPLIT
            pv = tl.load(
                part_val_ptr + t * (K * SPLIT) + offs,
                mask=p_ok,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            pi = tl.load(
                part_idx_ptr + t * (K * SPLIT) + offs, mask=p_ok, other=V, cache_modifier=".cg"
            )
            _, best = _best_of(pv, pi, 0, V)
            best = tl.where(best == V, 0, best)  # every candidate suppressed: argmax of -inf
            tl.store(out_ptr + t, best.to(tl.int64))
            tl.store(counter_ptr + t, 0)

    @triton.jit
    def _dense_argmax_kernel(
        h_ptr,  # [T, D]
        w_ptr,  # [V, D]
        ordering_ptr,  # [V] int32
        slot_ptr,  # [C, T] int32: slot of centroid c among token t's picks, -1 if not picked
        sup_ptr,  # [V] int8
        part_val_ptr,  # [T, K] fp32
        part_idx_ptr,  # [T, K] int32
        counter_ptr,  # [T] int32, zero on entry and on exit
        out_ptr,  # [T] int64
        T,
        D,
        K,
        TPC,
        stride_h,
        stride_w,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
        V: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        tb = tl.program_id(0)
        c = tl.program_id(1)
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        slot = tl.load(slot_ptr + c * T + offs_t, mask=t_ok, other=-1)
        member = slot >= 0
        # Centroid c's rows are read only if a token of this block picked it, and then once
        # for all of them: the lm_head traffic is the union of the block's picks.
        if tl.max(slot, axis=0) >= 0:
            best_v = tl.full([BLOCK_T], float("-inf"), tl.float32)
            best_i = tl.full([BLOCK_T], V, tl.int32)
            for r0 in range(0, TPC, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_ok = offs_r < TPC
                ids = tl.load(ordering_ptr + c * TPC + offs_r, mask=r_ok, other=0)
                acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
                for d0 in range(0, D, BLOCK_D):
                    offs_d = d0 + tl.arange(0, BLOCK_D)
                    d_ok = offs_d < D
                    a = tl.load(
                        h_ptr + offs_t[:, None] * stride_h + offs_d[None, :],
                        mask=member[:, None] & d_ok[None, :],
                        other=0.0,
                    )
                    b = tl.load(
                        w_ptr + ids[None, :].to(tl.int64) * stride_w + offs_d[:, None],
                        mask=r_ok[None, :] & d_ok[:, None],
                        other=0.0,
                    )
                    if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
                        a = a.to(tl.float32)
                        b = b.to(tl.float32)
                    acc = tl.dot(a, b, acc, input_precision=PRECISION)
                sup = tl.load(sup_ptr + ids, mask=r_ok, other=1)
                ok = member[:, None] & (r_ok & (sup == 0))[None, :]
                vals = tl.where(ok, acc, float("-inf"))
                cand = tl.where(ok, ids[None, :], V)
                m, i = _best_of(vals, cand, 1, V)
                take = (i < V) & ((m > best_v) | ((m == best_v) & (i < best_i)))
                best_v = tl.where(take, m, best_v)
                best_i = tl.where(take, i, best_i)
            tl.store(part_val_ptr + offs_t * K + slot, best_v, mask=member)
            tl.store(part_idx_ptr + offs_t * K + slot, best_i, mask=member)
            tl.debug_barrier()  # every thread's stores before the (releasing) counter updates
            done = tl.atomic_add(counter_ptr + offs_t, 1, mask=member, sem="acq_rel")
            fin = member & (done == K - 1)
            # The program bringing a token's K-th partial reduces that token's partials.
            if tl.max(fin.to(tl.int32), axis=0) > 0:
                tl.debug_barrier()
                offs_k = tl.arange(0, BLOCK_K)
                pm = fin[:, None] & (offs_k < K)[None, :]
                pv = tl.load(
                    part_val_ptr + offs_t[:, None] * K + offs_k[None, :],
                    mask=pm,
                    other=float("-inf"),
                    cache_modifier=".cg",
                )
                pi = tl.load(
                    part_idx_ptr + offs_t[:, None] * K + offs_k[None, :],
                    mask=pm,
                    other=V,
                    cache_modifier=".cg",
                )
                _, best = _best_of(pv, pi, 1, V)
                best = tl.where(best == V, 0, best)  # every candidate suppressed
                tl.store(out_ptr + offs_t, best.to(tl.int64), mask=fin)
                tl.store(counter_ptr + offs_t, tl.zeros([BLOCK_T], tl.int32), mask=fin)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

SCORES_BLOCK_C = 16
GATHER_SPLIT = 4
GATHER_BLOCK_R = 32
DENSE_BLOCK_R = 128
DENSE_BLOCK_D = 128
DENSE_MAX_BLOCK_T = 64


def _select_centroids(
    state: FusedCentroidState,
    hidden: torch.Tensor,
    centroids_weight: torch.Tensor,
    write_sel: bool,
    write_slot: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches kernel 1: returns (sel [T, K] int32, slot [C, T] int32); only the asked-for
    outputs are written."""
    num_tokens, d = hidden.shape
    c, k = state.num_centroids, state.top_k
    dev = hidden.device
    scores = torch.empty(num_tokens, c, dtype=torch.float32, device=dev)
    sel = torch.empty(num_tokens if write_sel else 1, k, dtype=torch.int32, device=dev)
    slot = torch.empty(c if write_slot else 1, num_tokens, dtype=torch.int32, device=dev)
    grid = (num_tokens, triton.cdiv(c, SCORES_BLOCK_C))
    _scores_select_kernel[grid](
        hidden,
        centroids_weight,
        scores,
        sel,
        slot,
        state.counters[0],
        num_tokens,
        c,
        d,
        k,
        hidden.stride(0),
        centroids_weight.stride(0),
        BLOCK_C=SCORES_BLOCK_C,
        BLOCK_D=min(256, triton.next_power_of_2(d)),
        BLOCK_ALL_C=triton.next_power_of_2(c),
        WRITE_SEL=write_sel,
        WRITE_SLOT=write_slot,
        num_warps=8 if c >= 2048 else 4,
    )
    return sel, slot


def _check(mask: CentroidMask, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
    if hidden.dim() != 2 or lm_head_weight.dim() != 2:
        raise ValueError("hidden [T, d] and lm_head_weight [V, d] expected")
    if not hidden.shape[1] == lm_head_weight.shape[1] == mask.centroids_weight.shape[1]:
        raise ValueError("hidden size mismatch")
    if any(x.stride(1) != 1 for x in (hidden, lm_head_weight, mask.centroids_weight)):
        raise ValueError("the hidden dimension must be contiguous")


def centroid_argmax_gather(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    state: FusedCentroidState | None = None,
) -> torch.Tensor:
    """Small-T path: two kernels, reading only the selected lm_head rows."""
    _check(mask, hidden, lm_head_weight)
    vocab = lm_head_weight.shape[0]
    state = state or _state_for(mask, vocab)
    num_tokens, d = hidden.shape
    out = torch.empty(num_tokens, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return out
    state.ensure_capacity(num_tokens)
    sel, _ = _select_centroids(state, hidden, mask.centroids_weight, True, False)
    k = state.top_k
    tpc = vocab // state.num_centroids
    split = max(1, min(GATHER_SPLIT, tpc // 16))
    rows = triton.cdiv(tpc, split)
    block_r = min(GATHER_BLOCK_R, triton.next_power_of_2(rows))
    part_val = torch.empty(num_tokens, k * split, dtype=torch.float32, device=hidden.device)
    part_idx = torch.empty(num_tokens, k * split, dtype=torch.int32, device=hidden.device)
    _gather_argmax_kernel[(num_tokens, k, split)](
        hidden,
        lm_head_weight,
        state.ordering,
        sel,
        state.suppressed,
        part_val,
        part_idx,
        state.counters[1],
        out,
        d,
        k,
        tpc,
        hidden.stride(0),
        lm_head_weight.stride(0),
        SPLIT=split,
        ROWS=rows,
        BLOCK_R=block_r,
        BLOCK_D=min(256, triton.next_power_of_2(d)),
        BLOCK_P=triton.next_power_of_2(k * split),
        V=vocab,
    )
    return out


def centroid_argmax_dense(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    state: FusedCentroidState | None = None,
) -> torch.Tensor:
    """Larger-T path: one program per (token block, centroid) reads that centroid's lm_head
    rows once for the whole token block (``tl.dot``), and only if some token of the block
    picked it; per-token partials per picked centroid, reduced by the last contributor."""
    _check(mask, hidden, lm_head_weight)
    vocab = lm_head_weight.shape[0]
    state = state or _state_for(mask, vocab)
    num_tokens, d = hidden.shape
    out = torch.empty(num_tokens, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return out
    state.ensure_capacity(num_tokens)
    _, slot = _select_centroids(state, hidden, mask.centroids_weight, False, True)
    k, c = state.top_k, state.num_centroids
    tpc = vocab // c
    block_t = min(DENSE_MAX_BLOCK_T, max(16, triton.next_power_of_2(num_tokens)))
    block_r = min(DENSE_BLOCK_R, max(16, triton.next_power_of_2(tpc)))
    part_val = torch.empty(num_tokens, k, dtype=torch.float32, device=hidden.device)
    part_idx = torch.empty(num_tokens, k, dtype=torch.int32, device=hidden.device)
    upcast = _interpreting() and hidden.dtype != torch.float32
    precision = "ieee" if hidden.dtype == torch.float32 or upcast else "tf32"
    _dense_argmax_kernel[(triton.cdiv(num_tokens, block_t), c)](
        hidden,
        lm_head_weight,
        state.ordering,
        slot,
        state.suppressed,
        part_val,
        part_idx,
        state.counters[2],
        out,
        num_tokens,
        d,
        k,
        tpc,
        hidden.stride(0),
        lm_head_weight.stride(0),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_D=min(DENSE_BLOCK_D, max(16, triton.next_power_of_2(d))),
        BLOCK_K=triton.next_power_of_2(k),
        V=vocab,
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=8 if block_t * block_r >= 8192 else 4,
    )
    return out


def centroid_argmax_fused(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    path: str = "auto",
    dense_min_tokens: int | None = None,
) -> torch.Tensor:
    """Greedy draft tokens ``[T]`` int64 through the fused kernels.

    ``path``: "auto" (gather below ``dense_min_tokens`` tokens, default ``DENSE_MIN_TOKENS``,
    dense from there), "gather" or "dense". Without Triton, or on a device the kernels cannot
    run on (CPU unless ``TRITON_INTERPRET=1``), falls back to the torch sparse path
    ``centroid_argmax``. Capturable in a CUDA graph once a first call has run for this mask
    and at least this many tokens."""
    if path not in ("auto", "gather", "dense"):
        raise ValueError(f"unknown path {path!r}")
    if not triton_usable(hidden.device):
        return centroid_argmax(hidden, lm_head_weight, mask)
    if path == "auto":
        threshold = DENSE_MIN_TOKENS if dense_min_tokens is None else dense_min_tokens
        path = "dense" if hidden.shape[0] >= threshold else "gather"
    if path == "dense":
        return centroid_argmax_dense(mask, hidden, lm_head_weight)
    return centroid_argmax_gather(mask, hidden, lm_head_weight)
