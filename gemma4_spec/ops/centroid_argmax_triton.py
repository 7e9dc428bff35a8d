"""Fused GPU kernels for the centroid-masked greedy argmax of a Gemma 4 assistant.

``centroid_argmax_fused(mask, hidden, lm_head_weight)`` returns the same draft tokens as
``centroid_argmax_reference`` (see ``centroid_argmax.py`` for the maths), without building the
gathered ``[T, top_k * V / C, d]`` rows or any ``[T, V]`` logits, in a fixed number of kernel
launches with no host synchronisation (CUDA-graph capturable).

Top-k by rank: centroid ``c`` is picked iff ``rank(c) < top_k``, where ``rank(c)`` counts the
centroids with a larger score plus those with an equal score and a smaller index (scores
compared as order-preserving int32 keys). Every centroid's rank is independent of the others',
so the work spreads over many programs, and a picked centroid writes itself at its rank. The
top-k-th best of G >= top_k group maxima, in the same order (score, then index), bounds the
top-k-th centroid from below, so only the centroids at or above it (few, for real data, and
about top_k when the scores tie) can be picked and need a rank. Candidate rows are
read through ``draft_ids``: the token ids in centroid order, -1 for a suppressed token.

* **small T** (``path="persistent"``, ``T < CENTROID_MIN_TOKENS``): one launch of
  ``_persistent_kernel``, grid ``(T, P)``, ``P`` a power of two from ``PERSISTENT_MIN_PROGRAMS``
  to ``PERSISTENT_PROGRAMS`` with all ``T * P`` programs resident at once: at most the SM count
  times how many programs of the compiled kernel one SM holds (``persistent_programs``: each
  candidate P, from the largest down, is compiled and its registers per thread, shared memory
  and warps go through CUDA's occupancy rules, ``programs_per_sm``, capped by the driver's own
  occupancy answer; one per SM if they cannot be read). Three phases separated by per-token
  grid barriers (arrive with a releasing atomic, spin on an acquiring one): (1) each program
  computes ``C / P`` fp32 centroid scores, while the draft ids of those centroids load; (2)
  each reads the token's ``C`` scores once, takes the bound (``2 * top_k`` groups) and, only if
  one of its centroids reaches it (few programs), ranks them against all ``C`` scores held in
  registers and writes each picked centroid's draft ids at its rank; (3) each scores its share
  of the ``top_k * V / C`` picked rows (ids, then lm_head rows) and keeps the best (value,
  smallest id); the last program to finish (a counter) reduces the ``P`` partials, writes the
  token, and resets the barrier and finish counters to zero (every program has passed both
  barriers by then) for the next call or graph replay. Under Triton's CPU interpreter, which
  runs programs one after another, the kernel is launched once per phase instead (the
  ``PHASE`` constexpr) with no barriers, unless ``P`` is 1 (a barrier of one program opens at
  once). Fewer than ``PERSISTENT_MIN_PROGRAMS`` per token resident: the next path.
* **larger T** (``path="centroid"``), three kernels:
  1. ``_scores_dot_kernel``, grid ``(T / BLOCK_T, C / BLOCK_C)``: fp32 scores by ``tl.dot``
     over token blocks, so the centroid weights are read once per token block, not per token.
  2. ``_select_rank_kernel``, grid ``(T,)``: the candidates at or above the bound (``4 *
     top_k`` groups; ~36 of 2048 scores at real dims) are compacted and ranked among
     themselves. Each pick is appended (atomic count) to its centroid's list ``picks[c]`` as
     ``t * top_k + rank``, and a centroid's first pick appends the centroid to the list of
     picked centroids.
  3. ``_centroid_argmax_kernel``, grid ``(min(C, T * top_k), CENTROID_SPLIT)``: program
     ``(n, s)`` takes the n-th picked centroid (nothing past the list's end), reads its part
     of that centroid's ``V / C`` lm_head rows once and ``tl.dot``s them with the hidden
     states of just the tokens in the centroid's list, 16 at a time, so the lm_head traffic
     is the union of all tokens' picks (at most the whole lm_head once, whatever T). The
     first picks and row ids load before the pick count. Per (token, rank, split) partial
     maxima; the program bringing a token's last partial reduces them.

``path="auto"`` takes the persistent kernel below ``CENTROID_MIN_TOKENS`` tokens (default 3,
environment variable ``GEMMA4_SPEC_DENSE_MIN_TOKENS``, or the ``centroid_min_tokens``
argument) when its grid fits the GPU, and the centroid-major path otherwise.

H200 (``benchmarks/results/h200/centroid_argmax-faa5724.json``), bf16, real E2B dims (V 262144,
C 2048, top-k 32, d 256), CUDA graphs, cold L2, median us, auto: T=1 14.1 (persistent, P 128),
T=2 17.1 (persistent; centroid path 19.6), T=3 19.6 (centroid; persistent 37.0 with P 32), T=4
20.3, T=8 22.7, T=16 29.5, T=32 38.9, T=64 52.0, T=256 69.9. vLLM's in-tree formula takes 50.9
to 999.1 over T=1..256, a full-vocab argmax 55.0 to 166.0, and the harness's floor (a graph of
one trivial kernel) 5.0. The module constants come from H200 sweeps
(``benchmarks/centroid_argmax_sweep.py``, ``centroid_sweep-*.log``; the results README says
which run chose what): for the persistent kernel, 8 warps and ``2 * top_k`` groups (T=1 13.7
vs 15.1 with 4 warps), ranking in registers rather than re-reading the scores (15.5 vs 16.5);
for the centroid path, the grid over picked centroids (18.6 vs 23.2 at T=1 with one program per
centroid, about even from T=64), two row splits of 64 rows (29.5 vs 30.6 at T=16), blocks of 64
candidates in the rank top-k. Tried and dropped: polling the grid barriers with plain loads
(16.0 vs 15.3 at T=1), prefetching the picked rows into L2 in phase 2 (16.6 vs 15.9), a radix
top-k followed by a per-token gather-argmax or a per-token-block dense argmax, a top-k with
``C / 32`` programs per token, and a sweep of the whole lm_head per 64-token block keeping
every centroid's best (86c995a: 71.8 at T=1, 99.3 at T=64, 252.2 at T=256). The CUDA tests pass
on the H200 (252 passed, ``test_kernels_cuda-faa5724.log``).

Caveats: the persistent kernel's barriers assume all its programs are resident together; a
kernel running concurrently on another stream that holds SMs until this one finishes could
deadlock it (nothing in the draft step does), and so would an occupancy over-estimate (the
driver's answer caps ours for that reason). The first call for each T compiles the candidate
P (a few seconds each): make it before graph capture.

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

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gemma4_spec.ops.centroid_argmax import CentroidMask, centroid_argmax

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without triton
    HAS_TRITON = False

# At or above this many tokens "auto" uses the centroid-major path, below it the persistent
# kernel: that one reads top_k * V / C rows (2 MiB in bf16 at E2B dims) per token in one launch,
# the centroid-major one each picked centroid's rows once for all tokens (the union of the
# picks, at most the whole lm_head) in three. 3 from the H200 timings of faa5724 (T = 2 / 3:
# persistent 17.2 / 37.0 us, centroid path 19.6 / 20.2; see the module docstring).
# Tunable with GEMMA4_SPEC_DENSE_MIN_TOKENS (its name from when the larger-T path was "dense").
CENTROID_MIN_TOKENS = int(os.environ.get("GEMMA4_SPEC_DENSE_MIN_TOKENS", "3"))


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

# Rows of ``FusedCentroidState.counters``: one per kernel counter, each [capacity] (per token).
_ROW_BAR1, _ROW_BAR2, _ROW_DONE = 0, 1, 2  # the persistent kernel's
_ROW_CENTROID = 3  # _centroid_argmax_kernel's
COUNTER_ROWS = 4


@dataclass
class FusedCentroidState:
    """Per-mask tensors the kernels read, built once (outside graph capture)."""

    # [V] int32: the token id at each position of the centroid ordering (centroid c's tokens at
    # [c * V / C, (c + 1) * V / C)), -1 where that token is suppressed: one load gives a
    # candidate row's id and whether it may be drafted.
    draft_ids: torch.Tensor
    counters: torch.Tensor  # [COUNTER_ROWS, capacity] int32, self-resetting, per token
    num_centroids: int
    vocab: int
    top_k: int
    # Counters outgrown by a larger batch, kept: a CUDA graph captured before the growth still
    # reads and resets them at every replay (freed, that memory would go to other tensors).
    retired: list[torch.Tensor] = field(default_factory=list)
    # Whether a CUDA graph was captured over this state (it then outlives the cache's entry).
    captured: bool = False

    def ensure_capacity(self, num_tokens: int) -> None:
        self.counters = grown_counters(
            self.counters, num_tokens, self.retired, "centroid argmax", "tokens"
        )


def grown_counters(
    counters: torch.Tensor, needed: int, retired: list[torch.Tensor], kernel: str, unit: str
) -> torch.Tensor:
    """``counters`` (self-resetting kernel counters, per ``unit`` along the last dimension) with
    room for ``needed``: the same tensor when it has, else a zeroed one twice as large (or
    ``needed``) with ``counters`` appended to ``retired``, since a CUDA graph captured before
    the growth still reads and resets it at every replay. Growing inside a capture would bake
    in memory the next growth frees: that raises."""
    capacity = counters.shape[-1]
    if needed <= capacity:
        return counters
    if _capturing(counters.device):
        raise RuntimeError(
            f"{kernel}: {needed} {unit} exceed the prepared capacity {capacity}; "
            "run once with the largest batch before capture"
        )
    retired.append(counters)
    shape = (*counters.shape[:-1], max(needed, 2 * capacity))
    return torch.zeros(shape, dtype=counters.dtype, device=counters.device)


def prepare_fused_centroid_argmax(
    mask: CentroidMask, vocab: int, capacity: int = 1024
) -> FusedCentroidState:
    """Builds the kernels' per-mask state: the ordering as int32 with the suppressed tokens
    marked -1 (``draft_ids``), and zeroed counters."""
    num_centroids = mask.centroids_weight.shape[0]
    if vocab % num_centroids != 0 or mask.token_ordering.numel() != vocab:
        raise ValueError("token_ordering must be a permutation of the vocab, C | V")
    if not 1 <= mask.top_k <= num_centroids:
        raise ValueError(f"top_k={mask.top_k} must be in [1, {num_centroids}]")
    device = mask.centroids_weight.device
    draft_ids = mask.token_ordering.to(device=device, dtype=torch.int32).clone()
    if mask.has_suppressed():
        assert mask.suppressed is not None
        draft_ids[torch.isin(draft_ids, mask.suppressed.to(device=device, dtype=torch.int32))] = -1
    counters = torch.zeros(COUNTER_ROWS, capacity, dtype=torch.int32, device=device)
    return FusedCentroidState(draft_ids.contiguous(), counters, num_centroids, vocab, mask.top_k)


# Keyed by the identity and version of the mask's tensors; the entry holds them alive, so an
# id cannot be reused by another tensor while its entry exists.
_STATE_CACHE: dict[tuple, tuple[tuple[torch.Tensor, ...], FusedCentroidState]] = {}
# Kernel states a CUDA graph was captured over (this module's and ``vocab_argmax_triton``'s),
# kept past their cache entries: the graph reads their tensors at every replay (vLLM's in-tree
# drafter crashed replaying a graph over a tensor freed after its capture, with tensor
# parallelism: vllm#43909).
_CAPTURED_STATES: list[object] = []


def keep_if_captured(state: Any, device: torch.device) -> None:
    """Marks ``state`` (a dataclass with a ``captured`` flag) as read by a CUDA graph and keeps
    it alive for good, when this call is inside a capture on ``device``."""
    if not state.captured and _capturing(device):
        state.captured = True
        _CAPTURED_STATES.append(state)


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
        state = hit[1]
    else:
        if len(_STATE_CACHE) >= 8:
            _STATE_CACHE.clear()  # captured states live on in _CAPTURED_STATES
        state = prepare_fused_centroid_argmax(mask, vocab)
        _STATE_CACHE[key] = (sources, state)
    keep_if_captured(state, state.draft_ids.device)
    return state


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``device``'s kind."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    def _best_of(vals, ids, axis: tl.constexpr, SENTINEL: tl.constexpr):
        """Max value along ``axis`` and the smallest id reaching it (SENTINEL if none valid)."""
        m = tl.max(vals, axis=axis)
        if axis == 0:
            hit = (vals == m) & (ids < SENTINEL)
        else:
            hit = (vals == m[:, None]) & (ids < SENTINEL)
        i = tl.min(tl.where(hit, ids, SENTINEL), axis=axis)
        return m, i

    # ---------------------------------------------------------------------------- rank top-k

    @triton.jit
    def _rank_against(key_i, idx_i, key_j, idx_j, j_ok):
        """For each i: #{j : key_j > key_i} + #{j : key_j == key_i, idx_j < idx_i}, over the
        ``j_ok`` entries (all four are register tensors: [I] for i, [J] for j)."""
        ahead = (key_j[None, :] > key_i[:, None]) | (
            (key_j[None, :] == key_i[:, None]) & (idx_j[None, :] < idx_i[:, None])
        )
        return tl.sum((ahead & j_ok[None, :]).to(tl.int32), axis=1)

    @triton.jit
    def _rank_block(
        key_i,  # [BLOCK_I] int32 keys of the centroids being ranked
        idx_i,  # [BLOCK_I] int32 their indices
        keys_ptr,  # fp32 scores (KEYS_ARE_SCORES) or int32 keys, the ones ranked against
        idx_ptr,  # int32 indices of those (only if not INDEX_IS_POS)
        n,  # how many to rank against
        BLOCK_I: tl.constexpr,
        CHUNK: tl.constexpr,
        KEYS_ARE_SCORES: tl.constexpr,
        INDEX_IS_POS: tl.constexpr,
    ):
        """``_rank_against`` the ``n`` entries at ``keys_ptr``, read in chunks of CHUNK
        (through L2: they may have been written by other programs)."""
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, n, CHUNK):
            offs_j = j0 + tl.arange(0, CHUNK)
            j_ok = offs_j < n
            if KEYS_ARE_SCORES:
                key_j = _score_keys(keys_ptr, offs_j, j_ok, ".cg")
            else:
                key_j = tl.load(keys_ptr + offs_j, mask=j_ok, other=0, cache_modifier=".cg")
            if INDEX_IS_POS:
                idx_j = offs_j
            else:
                idx_j = tl.load(idx_ptr + offs_j, mask=j_ok, other=0, cache_modifier=".cg")
            rank += _rank_against(key_i, idx_i, key_j, idx_j, j_ok)
        return rank

    @triton.jit
    def _rows_dot(
        acc,  # [M, N] fp32
        a_rows,  # [M] pointers to the first element of each A row
        a_ok,  # [M] rows to read (others count as zeros)
        b_rows,  # [N] pointers to the first element of each B row
        b_ok,  # [N]
        D,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """``acc + A @ B^T`` over the hidden dimension ``D``, by ``tl.dot`` tiles."""
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            a = tl.load(
                a_rows[:, None] + offs_d[None, :], mask=a_ok[:, None] & d_ok[None, :], other=0.0
            )
            b = tl.load(
                b_rows[:, None] + offs_d[None, :], mask=b_ok[:, None] & d_ok[None, :], other=0.0
            )
            if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _grid_barrier(counter_ptr, expected):
        """Every program of a token arrives (release) then waits (acquire) for all of them.
        Only valid when all of them are resident at once (the launcher sizes the grid so).
        (Polling with plain volatile loads before one acquiring atomic was slower on the H200:
        16.0 vs 15.3 us at T=1, 19.2 vs 17.4 at T=2; centroid_sweep-3832ed8.log.)"""
        tl.debug_barrier()  # every thread's stores happen before the releasing arrive
        tl.atomic_add(counter_ptr, 1, sem="release")
        while tl.atomic_add(counter_ptr, 0, sem="acquire") < expected:
            pass
        tl.debug_barrier()

    # ------------------------------------------------------------------- small T: one launch

    @triton.jit
    def _persistent_kernel(
        h_ptr,  # [T, D]
        cw_ptr,  # [C, D]
        w_ptr,  # [V, D] lm_head
        draft_ids_ptr,  # [V] int32: token ids in centroid order, -1 = suppressed
        scores_ptr,  # [T, C] fp32 scratch
        rows_ptr,  # [T, K * TPC] int32 scratch: the picked centroids' draft ids, by rank
        part_val_ptr,  # [T, P] fp32
        part_idx_ptr,  # [T, P] int32
        bar1_ptr,  # [T] int32, zero on entry and on exit
        bar2_ptr,  # [T] int32, zero on entry and on exit
        done_ptr,  # [T] int32, zero on entry and on exit
        out_ptr,  # [T] int64
        C,
        D,
        K,
        TPC,
        stride_h,
        stride_cw,
        stride_w,
        P: tl.constexpr,  # programs per token
        BLOCK_C: tl.constexpr,  # centroids per program (P * BLOCK_C >= C)
        BLOCK_TPC: tl.constexpr,  # >= TPC, a power of two
        ROWS: tl.constexpr,  # candidate rows per program (P * ROWS >= K * TPC)
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        RANK_CHUNK: tl.constexpr,
        RANK_IN_REGISTERS: tl.constexpr,  # rank against the scores held, not re-read
        BLOCK_ALL_C: tl.constexpr,  # >= C, a power of two
        GROUPS: tl.constexpr,  # a power of two >= K (and <= BLOCK_ALL_C)
        BLOCK_P: tl.constexpr,  # >= P
        V: tl.constexpr,
        PHASE: tl.constexpr,  # 0: all three with grid barriers; 1, 2, 3: that phase alone
    ):
        t = tl.program_id(0)
        p = tl.program_id(1)
        offs_c = p * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        if PHASE == 0 or PHASE == 2:
            # The draft ids of this program's centroids, for phase 2 to hand over the picked
            # ones: loaded first, so they arrive during phase 1 and the barrier.
            offs_i = tl.arange(0, BLOCK_TPC)
            i_ok = offs_i < TPC
            own_ids = tl.load(
                draft_ids_ptr + offs_c[:, None] * TPC + offs_i[None, :],
                mask=c_ok[:, None] & i_ok[None, :],
                other=-1,
            )
        # Phase 1: this program's centroid scores, fp32.
        if PHASE == 0 or PHASE == 1:
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                d_ok = offs_d < D
                hv = tl.load(h_ptr + t * stride_h + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                cw = tl.load(
                    cw_ptr + offs_c[:, None] * stride_cw + offs_d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(cw * hv[None, :], axis=1)
            tl.store(scores_ptr + t * C + offs_c, acc, mask=c_ok)
        if PHASE == 0:
            _grid_barrier(bar1_ptr + t, P)
        # Phase 2: the token's scores (written by every program: read through L2, ".cg") give
        # the group-maxima bound; a program with a centroid reaching it (few do) ranks its
        # centroids against all C, and writes each picked centroid's draft ids at its rank.
        if PHASE == 0 or PHASE == 2:
            offs_all = tl.arange(0, BLOCK_ALL_C)
            all_ok = offs_all < C
            all_key = _score_keys(scores_ptr + t * C, offs_all, all_ok, ".cg")
            # Its own scores are read back too (issued with the load above), not taken from
            # phase 1's registers: that hung the kernel on the H200 at a tiny config (C = 32,
            # one centroid per program), likely by splitting the warps at the branch below,
            # whose reductions synchronise the whole program (it showed in the CUDA test
            # test_counters_reset_after_every_path, T=1).
            own_key = _score_keys(scores_ptr + t * C, offs_c, c_ok, ".cg")
            bound_key, bound_idx = _kth_group_max(all_key, K, BLOCK_ALL_C, GROUPS)
            maybe = c_ok & _reaches(own_key, offs_c, bound_key, bound_idx)
            if tl.max(maybe.to(tl.int32), axis=0) > 0:
                if RANK_IN_REGISTERS:
                    rank = _rank_against(own_key, offs_c, all_key, offs_all, all_ok)
                else:
                    rank = _rank_block(
                        own_key, offs_c, scores_ptr + t * C, scores_ptr, C,
                        BLOCK_C, RANK_CHUNK, True, True,
                    )  # fmt: skip
                chosen = maybe & (rank < K)
                tl.store(
                    rows_ptr + t * K * TPC + rank[:, None] * TPC + offs_i[None, :],
                    own_ids,
                    mask=chosen[:, None] & i_ok[None, :],
                )
        if PHASE == 0:
            _grid_barrier(bar2_ptr + t, P)
        # Phase 3: this program's share of the K * TPC candidate rows; best (value, id).
        if PHASE == 0 or PHASE == 3:
            best_v = tl.full([BLOCK_R], float("-inf"), tl.float32)
            best_i = tl.full([BLOCK_R], V, tl.int32)
            for r0 in range(0, ROWS, BLOCK_R):
                local = r0 + tl.arange(0, BLOCK_R)
                j = p * ROWS + local
                r_ok = (local < ROWS) & (j < K * TPC)
                ids = tl.load(rows_ptr + t * K * TPC + j, mask=r_ok, other=-1, cache_modifier=".cg")
                ok = ids >= 0  # in range and not suppressed
                logit = tl.zeros([BLOCK_R], dtype=tl.float32)
                for e0 in range(0, D, BLOCK_D):
                    offs_e = e0 + tl.arange(0, BLOCK_D)
                    e_ok = offs_e < D
                    hv3 = tl.load(h_ptr + t * stride_h + offs_e, mask=e_ok, other=0.0)
                    w = tl.load(
                        w_ptr + ids[:, None].to(tl.int64) * stride_w + offs_e[None, :],
                        mask=ok[:, None] & e_ok[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    logit += tl.sum(w * hv3.to(tl.float32)[None, :], axis=1)
                take = ok & ((logit > best_v) | ((logit == best_v) & (ids < best_i)))
                best_v = tl.where(take, logit, best_v)
                best_i = tl.where(take, ids, best_i)
            m, i = _best_of(best_v, best_i, 0, V)
            tl.store(part_val_ptr + t * P + p, m)
            tl.store(part_idx_ptr + t * P + p, i)
            tl.debug_barrier()
            done = tl.atomic_add(done_ptr + t, 1, sem="acq_rel")
            if done == P - 1:
                # Every program of this token has passed both barriers: reset them here.
                tl.debug_barrier()
                offs = tl.arange(0, BLOCK_P)
                p_ok = offs < P
                pv = tl.load(
                    part_val_ptr + t * P + offs, mask=p_ok, other=float("-inf"),
                    cache_modifier=".cg",
                )  # fmt: skip
                pi = tl.load(part_idx_ptr + t * P + offs, mask=p_ok, other=V, cache_modifier=".cg")
                _, best = _best_of(pv, pi, 0, V)
                best = tl.where(best == V, 0, best)  # every candidate suppressed
                tl.store(out_ptr + t, best.to(tl.int64))
                tl.store(bar1_ptr + t, 0)
                tl.store(bar2_ptr + t, 0)
                tl.store(done_ptr + t, 0)

    # ---------------------------------------------------------- larger T: centroid-major path

    @triton.jit
    def _scores_dot_kernel(
        h_ptr,  # [T, D]
        cw_ptr,  # [C, D]
        scores_ptr,  # [T, C] fp32 out
        count_ptr,  # [C] int32 out: zeroed here for the select kernel
        picked_ptr,  # [C + 1] int32: its first entry zeroed here for the select kernel
        T,
        C,
        D,
        stride_h,
        stride_cw,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        tb = tl.program_id(0)
        cb = tl.program_id(1)
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        t_ok = offs_t < T
        c_ok = offs_c < C
        acc = _rows_dot(
            tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32),
            h_ptr + offs_t * stride_h, t_ok, cw_ptr + offs_c * stride_cw, c_ok,
            D, BLOCK_D, PRECISION, UPCAST,
        )  # fmt: skip
        tl.store(
            scores_ptr + offs_t[:, None] * C + offs_c[None, :],
            acc,
            mask=t_ok[:, None] & c_ok[None, :],
        )
        if tb == 0:
            tl.store(count_ptr + offs_c, tl.zeros([BLOCK_C], tl.int32), mask=c_ok)
            if cb == 0:
                tl.store(picked_ptr, 0)

    @triton.jit
    def _score_keys(row_ptr, offs, ok, CACHE: tl.constexpr):
        """Order-preserving int32 keys of the fp32 scores at ``row_ptr + offs``; the lowest
        key where not ``ok``. CACHE: the load's cache modifier (".cg" for scores written by
        other programs of the same launch)."""
        scores = tl.load(row_ptr + offs, mask=ok, other=0.0, cache_modifier=CACHE)
        return tl.where(ok, _sortable_key(scores), -(2**31))

    @triton.jit
    def _kth_group_max(key, K, BLOCK_ALL_C: tl.constexpr, GROUPS: tl.constexpr):
        """The K-th best of GROUPS (>= K) group maxima in the ranking order (key descending,
        then index ascending), as (key, index); group g holds centroids g, g + GROUPS, ....
        The K group maxima at or above it are K distinct centroids, so nothing below it in
        that order can be picked. With more groups than K it sits closer to the K-th best
        centroid than the worst group maximum does (at real dims, 4K groups leave ~36
        candidates per token where K groups leave ~130). Ordering by index as well keeps the
        candidates few when scores tie: a row of equal scores (a zero or NaN hidden state, as
        a CUDA graph's padding rows can hold) leaves the K smallest indices, not all C."""
        idx = tl.reshape(tl.arange(0, BLOCK_ALL_C), [BLOCK_ALL_C // GROUPS, GROUPS])
        key2 = tl.reshape(key, [BLOCK_ALL_C // GROUPS, GROUPS])
        m_key = tl.max(key2, axis=0)
        m_idx = tl.min(tl.where(key2 == m_key[None, :], idx, BLOCK_ALL_C), axis=0)
        ahead = (m_key[None, :] > m_key[:, None]) | (
            (m_key[None, :] == m_key[:, None]) & (m_idx[None, :] < m_idx[:, None])
        )
        kth = tl.sum(ahead.to(tl.int32), axis=1) == K - 1  # exactly one: the indices differ
        bound_key = tl.max(tl.where(kth, m_key, -(2**31)), axis=0)
        bound_idx = tl.min(tl.where(kth, m_idx, BLOCK_ALL_C), axis=0)
        return bound_key, bound_idx

    @triton.jit
    def _reaches(key, idx, bound_key, bound_idx):
        """Whether each (key, idx) is at or above the bound in the ranking order."""
        return (key > bound_key) | ((key == bound_key) & (idx <= bound_idx))

    @triton.jit
    def _append_picks(t, rank, idx, chosen, sel_ptr, count_ptr, pick_ptr, picked_ptr, T, K):
        """Token t picked centroids ``idx`` (where ``chosen``) at ``rank``: into sel[t, rank]
        and, as ``t * K + rank``, onto each centroid's list of picks; a centroid's first pick
        also appends it to the list of picked centroids (``picked_ptr[1:]``, its length at
        ``picked_ptr[0]``)."""
        tl.store(sel_ptr + t * K + rank, idx, mask=chosen)
        at = tl.atomic_add(count_ptr + idx, 1, mask=chosen, sem="relaxed")
        tl.store(pick_ptr + idx * T + at, t * K + rank, mask=chosen)
        first = chosen & (at == 0)
        slot = tl.atomic_add(picked_ptr + tl.zeros_like(idx), 1, mask=first, sem="relaxed")
        tl.store(picked_ptr + 1 + slot, idx, mask=first)

    @triton.jit
    def _select_rank_kernel(
        scores_ptr,  # [T, C] fp32
        cand_idx_ptr,  # [T, BLOCK_ALL_C] int32 scratch
        cand_key_ptr,  # [T, BLOCK_ALL_C] int32 scratch
        sel_ptr,  # [T, K] int32 out: selected centroid of each rank
        count_ptr,  # [C] int32, zero on entry: how many tokens picked each centroid
        pick_ptr,  # [C, T] int32 out: the picks of each centroid, as t * K + rank
        picked_ptr,  # [C + 1] int32, first entry zero on entry: the picked centroids
        T,
        C,
        K,
        BLOCK_ALL_C: tl.constexpr,
        GROUPS: tl.constexpr,  # a power of two >= K
        BLOCK_I: tl.constexpr,
    ):
        """One program per token. Only the centroids at or above the bound of
        ``_kth_group_max`` can be picked; they are compacted and ranked among themselves
        (one below the bound cannot be ahead of them)."""
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_ALL_C)
        ok = offs < C
        key = _score_keys(scores_ptr + t * C, offs, ok, "")
        bound_key, bound_idx = _kth_group_max(key, K, BLOCK_ALL_C, GROUPS)
        cand = ok & _reaches(key, offs, bound_key, bound_idx)
        pos = tl.cumsum(cand.to(tl.int32), axis=0) - 1
        n = tl.sum(cand.to(tl.int32), axis=0)
        base = t * BLOCK_ALL_C
        tl.store(cand_idx_ptr + base + pos, offs, mask=cand)
        tl.store(cand_key_ptr + base + pos, key, mask=cand)
        tl.debug_barrier()
        for i0 in range(0, n, BLOCK_I):
            offs_i = i0 + tl.arange(0, BLOCK_I)
            i_ok = offs_i < n
            idx_i = tl.load(cand_idx_ptr + base + offs_i, mask=i_ok, other=0)
            key_i = tl.load(cand_key_ptr + base + offs_i, mask=i_ok, other=0)
            rank = _rank_block(
                key_i, idx_i, cand_key_ptr + base, cand_idx_ptr + base, n,
                BLOCK_I, BLOCK_I, False, False,
            )  # fmt: skip
            chosen = i_ok & (rank < K)
            _append_picks(t, rank, idx_i, chosen, sel_ptr, count_ptr, pick_ptr, picked_ptr, T, K)

    @triton.jit
    def _centroid_argmax_kernel(
        h_ptr,  # [T, D]
        w_ptr,  # [V, D]
        draft_ids_ptr,  # [V] int32: token ids in centroid order, -1 = suppressed
        count_ptr,  # [C] int32
        pick_ptr,  # [C, T] int32: t * K + rank
        picked_ptr,  # [C + 1] int32: how many centroids were picked, then which
        part_val_ptr,  # [T, K * SPLIT] fp32
        part_idx_ptr,  # [T, K * SPLIT] int32
        counter_ptr,  # [T] int32, zero on entry and on exit
        out_ptr,  # [T] int64
        T,
        D,
        K,
        TPC,
        stride_h,
        stride_w,
        SPLIT: tl.constexpr,
        ROWS: tl.constexpr,  # rows of the centroid per program: TPC / SPLIT, rounded up
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,  # >= K * SPLIT
        V: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Program (n, s) reads rows [s * ROWS, (s + 1) * ROWS) of the n-th picked centroid c
        once (nothing to do past the list's end) and scores them for the tokens that picked
        c, BLOCK_T at a time. (One program per centroid, most with nothing to do, was slower
        below T = 64: 23.2 vs 18.6 us at T=1, centroid_sweep-c1f50a1.log.)"""
        s = tl.program_id(1)
        nth = tl.program_id(0)
        listed = nth < tl.load(picked_ptr)
        c = tl.where(listed, tl.load(picked_ptr + 1 + nth), 0)
        # Issued before the pick count, to be in flight with it rather than after it: the first
        # BLOCK_T picks (entries past the count are stale and masked off below) and the draft
        # ids of the first row tile.
        offs_t = tl.arange(0, BLOCK_T)
        first_pick = tl.load(pick_ptr + c * T + offs_t, mask=offs_t < T, other=0)
        local = tl.arange(0, BLOCK_R)
        offs_r = s * ROWS + local
        first_ids = tl.load(
            draft_ids_ptr + c * TPC + offs_r, mask=(local < ROWS) & (offs_r < TPC), other=-1
        )
        n = tl.load(count_ptr + c, mask=listed, other=0)
        for tb in range(0, n, BLOCK_T):
            offs_b = tb + offs_t
            b_ok = offs_b < n
            later = tl.load(pick_ptr + c * T + offs_b, mask=b_ok & (tb > 0), other=0)
            pick = tl.where(tb == 0, first_pick, later)
            tok = pick // K
            slot = (pick % K) * SPLIT + s
            best_v = tl.full([BLOCK_T], float("-inf"), tl.float32)
            best_i = tl.full([BLOCK_T], V, tl.int32)
            for r0 in range(0, ROWS, BLOCK_R):
                local = r0 + tl.arange(0, BLOCK_R)
                offs_r = s * ROWS + local
                later_ids = tl.load(
                    draft_ids_ptr + c * TPC + offs_r,
                    mask=(local < ROWS) & (offs_r < TPC) & (r0 > 0),
                    other=-1,
                )
                ids = tl.where(r0 == 0, first_ids, later_ids)
                r_ok = ids >= 0  # in range and not suppressed
                acc = _rows_dot(
                    tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32),
                    h_ptr + tok * stride_h, b_ok, w_ptr + ids.to(tl.int64) * stride_w, r_ok,
                    D, BLOCK_D, PRECISION, UPCAST,
                )  # fmt: skip
                ok = b_ok[:, None] & r_ok[None, :]
                vals = tl.where(ok, acc, float("-inf"))
                cand = tl.where(ok, ids[None, :], V)
                m, i = _best_of(vals, cand, 1, V)
                take = (i < V) & ((m > best_v) | ((m == best_v) & (i < best_i)))
                best_v = tl.where(take, m, best_v)
                best_i = tl.where(take, i, best_i)
            tl.store(part_val_ptr + tok * (K * SPLIT) + slot, best_v, mask=b_ok)
            tl.store(part_idx_ptr + tok * (K * SPLIT) + slot, best_i, mask=b_ok)
            tl.debug_barrier()  # every thread's stores before the (releasing) counter updates
            done = tl.atomic_add(counter_ptr + tok, 1, mask=b_ok, sem="acq_rel")
            fin = b_ok & (done == K * SPLIT - 1)
            # The program bringing a token's last partial reduces that token's partials.
            if tl.max(fin.to(tl.int32), axis=0) > 0:
                tl.debug_barrier()
                offs_p = tl.arange(0, BLOCK_P)
                pm = fin[:, None] & (offs_p < K * SPLIT)[None, :]
                pv = tl.load(
                    part_val_ptr + tok[:, None] * (K * SPLIT) + offs_p[None, :],
                    mask=pm,
                    other=float("-inf"),
                    cache_modifier=".cg",
                )
                pi = tl.load(
                    part_idx_ptr + tok[:, None] * (K * SPLIT) + offs_p[None, :],
                    mask=pm,
                    other=V,
                    cache_modifier=".cg",
                )
                _, best = _best_of(pv, pi, 1, V)
                best = tl.where(best == V, 0, best)  # every candidate suppressed
                tl.store(out_ptr + tok, best.to(tl.int64), mask=fin)
                tl.store(counter_ptr + tok, tl.zeros([BLOCK_T], tl.int32), mask=fin)

# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

PERSISTENT_PROGRAMS = 128  # programs per token of the persistent kernel, at most
PERSISTENT_INTERPRET_SMS = 16  # "SM count" under the interpreter (small test grids)
# Fewer programs per token on a GPU: the centroid path instead. Each program would hold C / P
# centroids' scores and K * V / C / P rows: compiled for sm_90 at the real dims, P = 4 spills
# 22 KB of stack per thread and takes ~50 s to compile, P = 1 ~9 minutes; and P = 8 (T=16)
# already took ~1.8x the centroid path's time on the H200.
PERSISTENT_MIN_PROGRAMS = 8
PERSISTENT_BLOCK_R = 64  # rows per step of phase 3 (more bytes in flight as T grows)
# Phase 2 ranks against the C scores it holds in registers when its compare tile, centroids per
# program x C (rounded up to powers of two), has at most this many elements (real dims: P >= 64
# programs per token); against chunks re-read from L2 otherwise.
PERSISTENT_RANK_IN_REGISTERS = 65536
PERSISTENT_WARPS = 8  # (at least 8 where a phase-3 step is >= 16384 elements)
PERSISTENT_GROUPS_PER_K = 2  # phase 2's bound, as SELECT_GROUPS_PER_K is the rank top-k's
SCORES_MAX_BLOCK_T = 64
SCORES_DOT_BLOCK_C = 64
SCORES_WARPS = 4
SELECT_BLOCK_I = 64
SELECT_WARPS = 8  # with C >= 2048 (4 below)
SELECT_GROUPS_PER_K = 4  # the rank top-k's bound: the K-th largest of this many x K group maxima
CENTROID_SPLIT = 2
CENTROID_BLOCK_T = 16
CENTROID_BLOCK_R = 64
CENTROID_BLOCK_D = 64
CENTROID_WARPS = 4


def _check(mask: CentroidMask, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
    if hidden.dim() != 2 or lm_head_weight.dim() != 2:
        raise ValueError("hidden [T, d] and lm_head_weight [V, d] expected")
    if not hidden.shape[1] == lm_head_weight.shape[1] == mask.centroids_weight.shape[1]:
        raise ValueError("hidden size mismatch")
    if any(x.stride(1) != 1 for x in (hidden, lm_head_weight, mask.centroids_weight)):
        raise ValueError("the hidden dimension must be contiguous")


def _dot_precision(hidden: torch.Tensor) -> tuple[str, bool]:
    """(tl.dot input precision, whether to upcast bf16 operands to fp32 first)."""
    upcast = _interpreting() and hidden.dtype != torch.float32
    return ("ieee" if hidden.dtype == torch.float32 or upcast else "tf32"), upcast


@dataclass(frozen=True)
class SmLimits:
    """What one SM holds at once, for the occupancy of a kernel (CUDA's occupancy rules)."""

    registers: int = 65536
    shared: int = 228 * 1024  # bytes, including the driver's reserve per block
    shared_per_block: int = 227 * 1024  # the most one block may use
    threads: int = 2048
    blocks: int = 32
    warp_size: int = 32


HOPPER_SM = SmLimits()  # H100 / H200 (sm_90); also A100 (sm_80) up to its 164 KiB of shared
_REG_ALLOC_UNIT = 256  # registers are allocated to a warp in units of this many
_REG_SUB_PARTITIONS = 4  # a warp's registers all come from one quarter of the SM's file
_SHARED_ALLOC_UNIT = 128  # bytes (sm_80 and later)
_SHARED_RESERVED = 1024  # bytes the driver keeps per resident block (sm_80 and later)


def programs_per_sm(n_regs: int, shared: int, num_warps: int, limits: SmLimits = HOPPER_SM) -> int:
    """How many programs (thread blocks) of a kernel one SM holds at once: the smallest of the
    thread, block, register and shared-memory limits; 0 if one program does not fit.

    ``n_regs``: registers per thread (as compiled; 0 counts as none), ``shared``: bytes of
    shared memory per program, ``num_warps``: warps per program."""
    if num_warps < 1 or n_regs < 0 or shared < 0:
        raise ValueError(f"bad kernel resources {n_regs=} {shared=} {num_warps=}")
    if shared > limits.shared_per_block:
        return 0
    by_threads = limits.threads // (num_warps * limits.warp_size)
    by_regs = limits.blocks
    regs_per_warp = -(-n_regs * limits.warp_size // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
    if regs_per_warp:
        per_partition = limits.registers // _REG_SUB_PARTITIONS // regs_per_warp
        by_regs = per_partition * _REG_SUB_PARTITIONS // num_warps
    block_shared = -(-(shared + _SHARED_RESERVED) // _SHARED_ALLOC_UNIT) * _SHARED_ALLOC_UNIT
    by_shared = limits.shared // block_shared
    return min(by_threads, limits.blocks, by_regs, by_shared)


def largest_resident_programs(
    num_tokens: int, sms: int, most: int, least: int, resident_per_sm: Callable[[int], int]
) -> int:
    """The largest power of two ``least <= P <= most`` whose ``num_tokens * P`` programs are
    all resident at once on ``sms`` SMs, each holding ``resident_per_sm(P)`` of them (the
    kernel's resources depend on P); 0 if none. Asks from the largest P down."""
    progs = 1 << (most.bit_length() - 1) if most >= 1 else 0
    while progs >= max(least, 1):
        if num_tokens * progs <= sms * resident_per_sm(progs):
            return progs
        progs //= 2
    return 0


_SM_LIMITS: dict[int, tuple[int, SmLimits]] = {}


def _device_sms(device: torch.device) -> tuple[int, SmLimits]:
    """(SM count, one SM's limits) of a CUDA device, from torch's properties where it has
    them (the Hopper figures otherwise)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_LIMITS:
        props = torch.cuda.get_device_properties(index)
        # 32 resident blocks on sm_80 / sm_90 / sm_100; fewer (16 or 24) on others: assume 16.
        blocks = HOPPER_SM.blocks if props.minor == 0 and props.major in (8, 9, 10) else 16
        limits = SmLimits(
            registers=getattr(props, "regs_per_multiprocessor", HOPPER_SM.registers),
            shared=getattr(props, "shared_memory_per_multiprocessor", HOPPER_SM.shared),
            shared_per_block=getattr(
                props, "shared_memory_per_block_optin", HOPPER_SM.shared_per_block
            ),
            threads=getattr(props, "max_threads_per_multi_processor", HOPPER_SM.threads),
            blocks=blocks,
            warp_size=getattr(props, "warp_size", HOPPER_SM.warp_size),
        )
        _SM_LIMITS[index] = (props.multi_processor_count, limits)
    return _SM_LIMITS[index]


def sm_count(device: torch.device, off_gpu: int) -> int:
    """The CUDA device's SM count; ``off_gpu`` for any other device (Triton's CPU interpreter,
    where a kernel's tests want a few programs' worth of splits)."""
    return _device_sms(device)[0] if device.type == "cuda" else off_gpu


def _driver_programs_per_sm(function: int, threads: int, shared: int) -> int | None:
    """The CUDA driver's own answer (cuOccupancyMaxActiveBlocksPerMultiprocessor) for a
    loaded kernel, or None if it cannot be asked."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        status = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(count), ctypes.c_void_p(function), ctypes.c_int(threads),
            ctypes.c_size_t(shared),
        )  # fmt: skip
    except (OSError, AttributeError, TypeError, ctypes.ArgumentError):
        return None
    return count.value if status == 0 else None


def _compiled_programs_per_sm(kernel: object, limits: SmLimits) -> int:
    """Programs of a compiled kernel (Triton's CompiledKernel) one SM holds at once: from its
    registers per thread, shared memory and warps, and never more than the driver says."""
    init = getattr(kernel, "_init_handles", None)
    if callable(init):
        init()  # loads the module: fills n_regs (and the driver's function handle)
    n_regs = getattr(kernel, "n_regs", None)
    try:  # Triton's compile metadata: shared-memory bytes and warps per program
        meta = kernel.metadata  # type: ignore[attr-defined]
        shared, num_warps = meta.shared, meta.num_warps
    except AttributeError:
        shared = num_warps = None
    if not (isinstance(n_regs, int) and isinstance(shared, int) and isinstance(num_warps, int)):
        raise AttributeError("no n_regs / metadata.shared / metadata.num_warps")
    resident = programs_per_sm(n_regs, shared, num_warps, limits)
    function = getattr(kernel, "function", None)
    if isinstance(function, int) and function:
        driver = _driver_programs_per_sm(function, num_warps * limits.warp_size, shared)
        if driver is not None and driver > 0:
            resident = min(resident, driver)
    return resident


def persistent_meta(progs: int, num_centroids: int, d: int, top_k: int, vocab: int) -> dict:
    """The persistent kernel's constexprs (and ``num_warps``) for ``progs`` programs per
    token, all but PHASE."""
    tpc = vocab // num_centroids
    block_c = triton.next_power_of_2(triton.cdiv(num_centroids, progs))
    rows = triton.cdiv(top_k * tpc, progs)
    block_r = min(PERSISTENT_BLOCK_R, triton.next_power_of_2(rows))
    block_d = min(256, triton.next_power_of_2(d))
    all_c = triton.next_power_of_2(num_centroids)
    return dict(
        P=progs,
        BLOCK_C=block_c,
        BLOCK_TPC=triton.next_power_of_2(tpc),
        ROWS=rows,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        RANK_CHUNK=max(16, min(all_c, 8192 // block_c)),
        RANK_IN_REGISTERS=block_c * all_c <= PERSISTENT_RANK_IN_REGISTERS,
        BLOCK_ALL_C=all_c,
        GROUPS=min(all_c, PERSISTENT_GROUPS_PER_K * triton.next_power_of_2(top_k)),
        BLOCK_P=triton.next_power_of_2(progs),
        V=vocab,
        # more rows in flight per program where a step's tile is large
        num_warps=max(8, PERSISTENT_WARPS) if block_r * block_d >= 16384 else PERSISTENT_WARPS,
    )


def _persistent_launch(
    state: FusedCentroidState,
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    out: torch.Tensor,
    progs: int,
) -> tuple[tuple, dict]:
    """The persistent kernel's arguments (with fresh scratch) and ``persistent_meta`` for
    ``progs`` programs per token."""
    num_tokens, d = hidden.shape
    dev = hidden.device
    c, k, vocab = state.num_centroids, state.top_k, state.vocab
    scores = torch.empty(num_tokens, c, dtype=torch.float32, device=dev)
    rows = torch.empty(num_tokens, k * (vocab // c), dtype=torch.int32, device=dev)
    part_val = torch.empty(num_tokens, progs, dtype=torch.float32, device=dev)
    part_idx = torch.empty(num_tokens, progs, dtype=torch.int32, device=dev)
    args = (
        hidden, mask.centroids_weight, lm_head_weight, state.draft_ids, scores, rows,
        part_val, part_idx,
        state.counters[_ROW_BAR1], state.counters[_ROW_BAR2], state.counters[_ROW_DONE], out,
        c, d, k, vocab // c, hidden.stride(0), mask.centroids_weight.stride(0),
        lm_head_weight.stride(0),
    )  # fmt: skip
    return args, persistent_meta(progs, c, d, k, vocab)


# Programs per token of the persistent kernel, per (tokens, device, dtypes, shapes, strides).
_PERSISTENT_PROGRAMS: dict[tuple, int] = {}


def persistent_programs(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    state: FusedCentroidState | None = None,
) -> int:
    """Programs per token ``P`` the persistent kernel runs these inputs with: a power of two,
    at most PERSISTENT_PROGRAMS (and C), with all ``T * P`` programs resident at once, as
    many per SM as the compiled kernel's registers, shared memory and warps allow (each
    candidate P is compiled, from the largest down, the first call for a shape); 0 if not
    even PERSISTENT_MIN_PROGRAMS per token fit. Under the interpreter: one per "SM", of
    PERSISTENT_INTERPRET_SMS, down to 1 per token."""
    if not triton_usable(hidden.device):
        return 0
    _check(mask, hidden, lm_head_weight)
    num_tokens = hidden.shape[0]
    c = mask.centroids_weight.shape[0]
    most = min(PERSISTENT_PROGRAMS, c)
    if _interpreting():
        return largest_resident_programs(num_tokens, PERSISTENT_INTERPRET_SMS, most, 1, lambda p: 1)
    tensors = (hidden, mask.centroids_weight, lm_head_weight)
    key = (
        num_tokens, str(hidden.device), mask.top_k,
        tuple((x.dtype, tuple(x.shape), x.stride(0)) for x in tensors),
    )  # fmt: skip
    if key in _PERSISTENT_PROGRAMS:
        return _PERSISTENT_PROGRAMS[key]
    sms, limits = _device_sms(hidden.device)
    prepared = state or _state_for(mask, lm_head_weight.shape[0])
    out = torch.empty(num_tokens, dtype=torch.int64, device=hidden.device)

    def resident_per_sm(progs: int) -> int:
        args, meta = _persistent_launch(prepared, mask, hidden, lm_head_weight, out, progs)
        ceiling = programs_per_sm(0, 0, meta["num_warps"], limits)  # threads and blocks
        if num_tokens * progs > sms * ceiling:
            return ceiling  # too many whatever the registers: no need to compile it
        try:
            kernel = _persistent_kernel.warmup(*args, grid=(num_tokens, progs), PHASE=0, **meta)
            return _compiled_programs_per_sm(kernel, limits)
        except Exception:  # a Triton without these attributes, a kernel that cannot load...
            return 1  # ...: the old rule, one program per SM (a launch error shows there)

    least = min(PERSISTENT_MIN_PROGRAMS, most)
    progs = largest_resident_programs(num_tokens, sms, most, least, resident_per_sm)
    if len(_PERSISTENT_PROGRAMS) >= 256:
        _PERSISTENT_PROGRAMS.clear()
    _PERSISTENT_PROGRAMS[key] = progs
    return progs


def centroid_argmax_persistent(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    state: FusedCentroidState | None = None,
    phased: bool = False,
) -> torch.Tensor:
    """Small-T path: one launch of ``_persistent_kernel``, ``P`` programs per token
    (``persistent_programs``) that compute the centroid scores, rank them and score the picked
    rows, separated by per-token grid barriers (under the interpreter, or with ``phased``:
    three launches, one per phase, no barriers; the benchmark times both to see what the
    barriers cost). With more tokens than the GPU holds programs it runs the centroid-major
    path instead."""
    _check(mask, hidden, lm_head_weight)
    vocab = lm_head_weight.shape[0]
    state = state or _state_for(mask, vocab)
    num_tokens = hidden.shape[0]
    out = torch.empty(num_tokens, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return out
    progs = persistent_programs(mask, hidden, lm_head_weight, state)
    if progs == 0:  # not all resident at once: the grid barriers could deadlock
        return centroid_argmax_centroid_major(mask, hidden, lm_head_weight, state)
    state.ensure_capacity(num_tokens)
    args, meta = _persistent_launch(state, mask, hidden, lm_head_weight, out, progs)
    grid = (num_tokens, progs)
    if (phased or _interpreting()) and progs > 1:  # the interpreter runs programs in turn: a
        for phase in (1, 2, 3):  # barrier with several programs per token would never open
            _persistent_kernel[grid](*args, PHASE=phase, **meta)
    else:
        _persistent_kernel[grid](*args, PHASE=0, **meta)
    return out


def centroid_scores(
    state: FusedCentroidState, hidden: torch.Tensor, centroids_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 1 of the centroid-major path: fp32 centroid scores ``[T, C]`` by ``tl.dot`` over
    token blocks; also returns the per-centroid pick counts ``[C]`` int32 and the list of
    picked centroids ``[C + 1]`` int32 whose length (first entry) it zeroes."""
    num_tokens, d = hidden.shape
    c = state.num_centroids
    dev = hidden.device
    scores = torch.empty(num_tokens, c, dtype=torch.float32, device=dev)
    count = torch.empty(c, dtype=torch.int32, device=dev)
    picked = torch.empty(c + 1, dtype=torch.int32, device=dev)
    precision, upcast = _dot_precision(hidden)
    block_t = min(SCORES_MAX_BLOCK_T, max(16, triton.next_power_of_2(num_tokens)))
    block_c = SCORES_DOT_BLOCK_C if num_tokens > 64 else SCORES_DOT_BLOCK_C // 2
    block_c = max(16, min(block_c, triton.next_power_of_2(c)))
    _scores_dot_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(c, block_c))](
        hidden, centroids_weight, scores, count, picked, num_tokens, c, d,
        hidden.stride(0), centroids_weight.stride(0),
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_D=min(64, max(16, triton.next_power_of_2(d))),
        PRECISION=precision, UPCAST=upcast, num_warps=SCORES_WARPS,
    )  # fmt: skip
    return scores, count, picked


class RankedPicks(NamedTuple):
    """What the rank top-k leaves for the centroid-major kernel (all int32)."""

    sel: torch.Tensor  # [T, K]: the centroid of each rank
    count: torch.Tensor  # [C]: how many tokens picked each centroid
    picks: torch.Tensor  # [C, T]: row c's first count[c] entries are t * K + rank, unordered
    picked: torch.Tensor  # [C + 1]: how many centroids were picked, then those, unordered


def select_centroids_ranked(
    state: FusedCentroidState,
    hidden: torch.Tensor,
    centroids_weight: torch.Tensor,
) -> RankedPicks:
    """Kernels 1 and 2 of the centroid-major path: fp32 scores (``centroid_scores``), then
    each token's top-k by rank (``_select_rank_kernel``, one program per token)."""
    num_tokens = hidden.shape[0]
    c, k = state.num_centroids, state.top_k
    dev = hidden.device
    scores, count, picked = centroid_scores(state, hidden, centroids_weight)
    picks = torch.empty(c, num_tokens, dtype=torch.int32, device=dev)
    sel = torch.empty(num_tokens, k, dtype=torch.int32, device=dev)
    all_c = triton.next_power_of_2(c)
    groups = min(all_c, SELECT_GROUPS_PER_K * triton.next_power_of_2(k))
    cand_idx = torch.empty(num_tokens, all_c, dtype=torch.int32, device=dev)
    cand_key = torch.empty(num_tokens, all_c, dtype=torch.int32, device=dev)
    _select_rank_kernel[(num_tokens,)](
        scores, cand_idx, cand_key, sel, count, picks, picked, num_tokens, c, k,
        BLOCK_ALL_C=all_c, GROUPS=groups,
        BLOCK_I=min(SELECT_BLOCK_I, all_c), num_warps=SELECT_WARPS if all_c >= 2048 else 4,
    )  # fmt: skip
    return RankedPicks(sel, count, picks, picked)


def centroid_argmax_centroid_major(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    state: FusedCentroidState | None = None,
) -> torch.Tensor:
    """Larger-T path: scores (``tl.dot``), rank top-k (``select_centroids_ranked``), then one
    program per (centroid, row split) that reads its rows once, only if some token picked the
    centroid, and scores them for just those tokens; per (token, pick, split) partials reduced
    by the last contributor. The lm_head traffic is the union of all tokens' picks, at most
    the whole lm_head once."""
    _check(mask, hidden, lm_head_weight)
    vocab = lm_head_weight.shape[0]
    state = state or _state_for(mask, vocab)
    num_tokens, d = hidden.shape
    out = torch.empty(num_tokens, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return out
    state.ensure_capacity(num_tokens)
    ranked = select_centroids_ranked(state, hidden, mask.centroids_weight)
    k, c = state.top_k, state.num_centroids
    tpc = vocab // c
    split = max(1, min(CENTROID_SPLIT, tpc // 16))
    rows = triton.cdiv(tpc, split)
    part_val = torch.empty(num_tokens, k * split, dtype=torch.float32, device=hidden.device)
    part_idx = torch.empty(num_tokens, k * split, dtype=torch.int32, device=hidden.device)
    precision, upcast = _dot_precision(hidden)
    # One program per centroid some token may have picked: at most T * K of them.
    _centroid_argmax_kernel[(min(c, num_tokens * k), split)](
        hidden, lm_head_weight, state.draft_ids, ranked.count, ranked.picks, ranked.picked,
        part_val, part_idx, state.counters[_ROW_CENTROID], out,
        num_tokens, d, k, tpc, hidden.stride(0), lm_head_weight.stride(0),
        SPLIT=split,
        ROWS=rows,
        BLOCK_T=CENTROID_BLOCK_T,
        BLOCK_R=min(CENTROID_BLOCK_R, max(16, triton.next_power_of_2(rows))),
        BLOCK_D=min(CENTROID_BLOCK_D, max(16, triton.next_power_of_2(d))),
        BLOCK_P=triton.next_power_of_2(k * split),
        V=vocab,
        PRECISION=precision,
        UPCAST=upcast,
        num_warps=CENTROID_WARPS,
    )  # fmt: skip
    return out


PATHS = ("auto", "persistent", "centroid")


def centroid_argmax_fused(
    mask: CentroidMask,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    path: str = "auto",
    centroid_min_tokens: int | None = None,
) -> torch.Tensor:
    """Greedy draft tokens ``[T]`` int64 through the fused kernels.

    ``path``: "auto" (the persistent kernel below ``centroid_min_tokens`` tokens, default
    ``CENTROID_MIN_TOKENS``, when its grid fits the GPU; the centroid-major path otherwise),
    "persistent" or "centroid". Without Triton, or on a device the kernels cannot run on (CPU
    unless ``TRITON_INTERPRET=1``), falls back to the torch sparse path ``centroid_argmax``.
    Capturable in a CUDA graph once a first call has run for this mask and at least this many
    tokens."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}")
    if not triton_usable(hidden.device):
        return centroid_argmax(hidden, lm_head_weight, mask)
    if path == "auto":
        threshold = CENTROID_MIN_TOKENS if centroid_min_tokens is None else centroid_min_tokens
        # The persistent path itself runs the centroid-major one when its grid does not fit.
        path = "persistent" if hidden.shape[0] < threshold else "centroid"
    if path == "persistent":
        return centroid_argmax_persistent(mask, hidden, lm_head_weight)
    return centroid_argmax_centroid_major(mask, hidden, lm_head_weight)
