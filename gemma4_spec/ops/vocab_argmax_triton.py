"""The full-vocabulary greedy argmax of a Gemma 4 assistant in one Triton launch.

``vocab_argmax(hidden, lm_head_weight, suppressed)`` returns the tokens of
``vocab_argmax_reference`` (``vocab_argmax.py``: float32 dot products, suppressed tokens never
chosen, ties to the smallest id) without the ``[T, V]`` logits the in-tree formula writes and
reads back (``lm_head(h)``, soft-cap, ``argmax``: several passes over ``T x V`` values per
draft step), with no host synchronisation (CUDA-graph capturable).

``_vocab_argmax_kernel``, grid ``(token blocks x vocab splits,)``: program ``(b, s)`` takes
``BLOCK_T`` tokens and the ``s``-th contiguous run of ``TILES_PER_SPLIT`` lm_head tiles of
``BLOCK_V`` rows. Per tile it computes ``W_tile [BLOCK_V, H] @ h^T [H, BLOCK_T]`` with
``tl.dot`` (the vocabulary is the MMA's M side, so a handful of tokens still fills it), masks
the rows past ``V`` and the suppressed tokens, and keeps each token's best (value, smallest id).
Its partial goes to ``[T, splits]`` scratch; the program that brings a token block's last
partial (an atomic counter per block) reduces them, writes the ``[T]`` int64 tokens and sets
the counter back to zero for the next call or graph replay. The token-block index varies
fastest over the grid, so the programs that read the same lm_head tiles run together and all
but the first read them from L2: HBM sees the lm_head about once, whatever ``T``.

Sizes (``vocab_argmax_config``): ``BLOCK_T`` the next power of two >= T between 16 (the
smallest ``tl.dot`` side) and 128; 128 rows by 64 hidden per step; vocab splits so that
``VOCAB_PROGRAMS_PER_SM`` programs per SM run in all (one wave, every program reading a
similar share: the lm_head is 2048 tiles of 128 rows at V=262144). Up to ``T`` of about 200
(the H200's flops per byte of HBM in bf16) the kernel is bound by reading the lm_head
(512 MiB in bf16 at H=1024, V=262144); above, by the MMA.

On bfloat16 inputs the MMA sums in another order than torch, so a token can differ from the
reference only where two logits are within float32 rounding of each other. Under Triton's CPU
interpreter (``TRITON_INTERPRET=1``) the kernel runs on CPU tensors (programs one after
another: the last-arriving reduction still holds); elsewhere without CUDA the reference runs.

Persistent state (the suppressed-token mask and the counters) is built by the first call for
a (suppressed tokens, vocab, device), outside graph capture: capture after one eager call, as
the draft sampler's graphs do. Two calls sharing that state must not run concurrently on
different streams (they would share counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from gemma4_spec.ops.centroid_argmax_triton import (
    HAS_TRITON,
    _capturing,
    _dot_precision,
    grown_counters,
    keep_if_captured,
    sm_count,
    triton_usable,
)
from gemma4_spec.ops.vocab_argmax import vocab_argmax_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from gemma4_spec.ops.centroid_argmax_triton import _best_of

# Programs per SM the vocab splits aim at (all of them in one wave).
VOCAB_PROGRAMS_PER_SM = 2
VOCAB_INTERPRET_SMS = 4  # "SM count" under the interpreter: several splits in small tests
VOCAB_BLOCK_V = 128
VOCAB_BLOCK_K = 64
VOCAB_MAX_BLOCK_T = 128
VOCAB_REDUCE_SPLITS = 64  # partials per step of the final reduction


class VocabArgmaxConfig(NamedTuple):
    """Tile sizes and grid of one launch."""

    block_t: int  # tokens per program, a power of two >= 16
    block_v: int  # lm_head rows per tile, a power of two >= 16
    block_k: int  # hidden elements per tl.dot step, a power of two >= 16
    splits: int  # programs per token block (each a contiguous run of tiles); >= 1
    num_warps: int
    num_stages: int


def vocab_argmax_config(
    num_tokens: int, vocab: int, hidden_size: int, device: torch.device
) -> VocabArgmaxConfig:
    """The sizes ``vocab_argmax`` launches with for these dimensions (module docstring)."""
    block_t = min(VOCAB_MAX_BLOCK_T, max(16, triton.next_power_of_2(max(num_tokens, 1))))
    block_k = min(VOCAB_BLOCK_K, max(16, triton.next_power_of_2(hidden_size)))
    block_v = min(VOCAB_BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    sms = sm_count(device, VOCAB_INTERPRET_SMS)
    token_blocks = triton.cdiv(max(num_tokens, 1), block_t)
    splits = max(1, sms * VOCAB_PROGRAMS_PER_SM // token_blocks)
    big = block_t >= 128  # a 128 x 128 fp32 accumulator: 8 warps, one stage less of smem
    return VocabArgmaxConfig(
        block_t, block_v, block_k, splits, num_warps=8 if big else 4, num_stages=3 if big else 4
    )


@dataclass
class VocabArgmaxState:
    """What the kernel keeps between calls for a (suppressed tokens, vocab, device)."""

    suppressed_mask: torch.Tensor | None  # [V] int8, 1 = never drafted; None: nothing is
    counters: torch.Tensor  # [capacity] int32 per token block, zero between calls
    # Counters outgrown by a larger batch, kept for the graphs captured over them.
    retired: list[torch.Tensor] = field(default_factory=list)
    # Whether a CUDA graph was captured over this state (it then outlives the cache's entry).
    captured: bool = False

    def ensure_capacity(self, token_blocks: int) -> None:
        self.counters = grown_counters(
            self.counters, token_blocks, self.retired, "vocab argmax", "token blocks"
        )


def prepare_vocab_argmax(
    vocab: int, device: torch.device, suppressed: torch.Tensor | None = None, capacity: int = 64
) -> VocabArgmaxState:
    """The kernel's persistent state: the suppressed tokens as a ``[V]`` mask (one byte per
    token, read with the lm_head rows; 256 KiB at V=262144 against 512 MiB of lm_head) and
    zeroed counters for ``capacity`` token blocks."""
    mask = None
    if suppressed is not None and suppressed.numel() > 0:
        ids = suppressed.to(device=device, dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"suppressed token ids must be in [0, {vocab})")
        mask = torch.zeros(vocab, dtype=torch.int8, device=device)
        mask[ids] = 1
    counters = torch.zeros(capacity, dtype=torch.int32, device=device)
    return VocabArgmaxState(mask, counters)


# Keyed by the identity and version of the suppressed tensor; the entry holds it alive, so its
# id cannot be reused by another tensor while the entry exists.
_STATE_CACHE: dict[tuple, tuple[torch.Tensor | None, VocabArgmaxState]] = {}


def _state_for(
    vocab: int, device: torch.device, suppressed: torch.Tensor | None
) -> VocabArgmaxState:
    present = suppressed is not None and suppressed.numel() > 0
    source = suppressed if present else None
    key = ((id(source), source._version) if source is not None else None, vocab, str(device))
    hit = _STATE_CACHE.get(key)
    if hit is not None:
        state = hit[1]
    else:
        if _capturing(device):
            raise RuntimeError(
                "vocab argmax: first call for these suppressed tokens inside graph capture; "
                "call it once eagerly first (it builds the suppressed mask and counters)"
            )
        if len(_STATE_CACHE) >= 8:
            _STATE_CACHE.clear()  # captured states live on in keep_if_captured's list
        state = prepare_vocab_argmax(vocab, device, source)
        _STATE_CACHE[key] = (source, state)
    keep_if_captured(state, device)
    return state


if HAS_TRITON:

    @triton.jit(do_not_specialize=["T"])
    def _vocab_argmax_kernel(
        h_ptr,  # [T, H]
        w_ptr,  # [V, H] lm_head
        suppressed_ptr,  # [V] int8, 1 = never chosen (read only if HAS_SUPPRESSED)
        part_val_ptr,  # [T, SPLITS] fp32 scratch: each split's best logit per token
        part_idx_ptr,  # [T, SPLITS] int32 scratch: its token id (V: none)
        counter_ptr,  # [token blocks] int32, zero on entry and on exit
        out_ptr,  # [T] int64
        T,
        H,
        stride_h,
        stride_w,
        SPLITS,
        TILES_PER_SPLIT,
        V: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        REDUCE_S: tl.constexpr,
        HAS_SUPPRESSED: tl.constexpr,
        EVEN_K: tl.constexpr,  # H % BLOCK_K == 0: no mask along the hidden dimension
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        token_blocks = tl.cdiv(T, BLOCK_T)
        b = pid % token_blocks  # fastest: programs of one split run together (L2 reuse)
        s = pid // token_blocks
        offs_t = b * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        h_rows = h_ptr + offs_t * stride_h
        best_v = tl.full([BLOCK_T], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK_T], V, tl.int32)
        for j in range(0, TILES_PER_SPLIT):
            ids = (s * TILES_PER_SPLIT + j) * BLOCK_V + tl.arange(0, BLOCK_V)
            v_ok = ids < V
            w_rows = w_ptr + ids.to(tl.int64) * stride_w
            acc = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                if EVEN_K:
                    w_mask = v_ok[:, None]
                    h_mask = t_ok[:, None]
                else:
                    w_mask = v_ok[:, None] & (offs_k < H)[None, :]
                    h_mask = t_ok[:, None] & (offs_k < H)[None, :]
                w = tl.load(w_rows[:, None] + offs_k[None, :], mask=w_mask, other=0.0)
                h = tl.load(h_rows[:, None] + offs_k[None, :], mask=h_mask, other=0.0)
                if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
                    w = w.to(tl.float32)
                    h = h.to(tl.float32)
                acc = tl.dot(w, tl.trans(h), acc, input_precision=PRECISION)
            keep = v_ok
            if HAS_SUPPRESSED:
                keep = keep & (tl.load(suppressed_ptr + ids, mask=v_ok, other=1) == 0)
            vals = tl.where(keep[:, None], acc, float("-inf"))
            m, i = _best_of(vals, tl.where(keep, ids, V)[:, None], 0, V)
            take = (i < V) & ((m > best_v) | ((m == best_v) & (i < best_i)))
            best_v = tl.where(take, m, best_v)
            best_i = tl.where(take, i, best_i)
        tl.store(part_val_ptr + offs_t * SPLITS + s, best_v, mask=t_ok)
        tl.store(part_idx_ptr + offs_t * SPLITS + s, best_i, mask=t_ok)
        tl.debug_barrier()  # every thread's stores before the (releasing) counter update
        done = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel")
        if done == SPLITS - 1:
            # The last split of this token block: reduce its partials (written by other
            # programs: read through L2, ".cg"). Splits ascend with token ids, so the
            # smallest id among equal maxima is the reference's first maximal index.
            tl.debug_barrier()
            fin_v = tl.full([BLOCK_T], float("-inf"), tl.float32)
            fin_i = tl.full([BLOCK_T], V, tl.int32)
            for s0 in range(0, SPLITS, REDUCE_S):
                offs_s = s0 + tl.arange(0, REDUCE_S)
                pm = t_ok[:, None] & (offs_s < SPLITS)[None, :]
                at = offs_t[:, None] * SPLITS + offs_s[None, :]
                pv = tl.load(part_val_ptr + at, mask=pm, other=float("-inf"), cache_modifier=".cg")
                pi = tl.load(part_idx_ptr + at, mask=pm, other=V, cache_modifier=".cg")
                m, i = _best_of(pv, pi, 1, V)
                take = (i < V) & ((m > fin_v) | ((m == fin_v) & (i < fin_i)))
                fin_v = tl.where(take, m, fin_v)
                fin_i = tl.where(take, i, fin_i)
            fin_i = tl.where(fin_i == V, 0, fin_i)  # every token suppressed: argmax's 0
            tl.store(out_ptr + offs_t, fin_i.to(tl.int64), mask=t_ok)
            tl.store(counter_ptr + b, 0)


def _check(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
    if hidden.dim() != 2 or lm_head_weight.dim() != 2:
        raise ValueError("hidden [T, H] and lm_head_weight [V, H] expected")
    if hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError("hidden size mismatch")
    if hidden.stride(1) != 1 or lm_head_weight.stride(1) != 1:
        raise ValueError("the hidden dimension must be contiguous")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"dtypes differ: hidden {hidden.dtype}, lm_head {lm_head_weight.dtype}")


def vocab_argmax(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    suppressed: torch.Tensor | None = None,
    config: VocabArgmaxConfig | None = None,
) -> torch.Tensor:
    """Greedy token ids ``[T]`` int64 of ``hidden [T, H]`` over the lm_head ``[V, H]``, never
    a ``suppressed`` id: ``vocab_argmax_reference``'s, in one launch where Triton runs (the
    reference elsewhere). ``config``: tile sizes and grid (default ``vocab_argmax_config``).
    Capturable in a CUDA graph once a first call has run for these suppressed tokens and at
    least this many tokens."""
    if not triton_usable(hidden.device):
        return vocab_argmax_reference(hidden, lm_head_weight, suppressed)
    _check(hidden, lm_head_weight)
    num_tokens, hidden_size = hidden.shape
    vocab = lm_head_weight.shape[0]
    out = torch.empty(num_tokens, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return out
    cfg = config or vocab_argmax_config(num_tokens, vocab, hidden_size, hidden.device)
    state = _state_for(vocab, hidden.device, suppressed)
    token_blocks = triton.cdiv(num_tokens, cfg.block_t)
    state.ensure_capacity(token_blocks)
    tiles = triton.cdiv(vocab, cfg.block_v)
    per_split = triton.cdiv(tiles, min(cfg.splits, tiles))
    splits = triton.cdiv(tiles, per_split)  # no split without tiles
    part_val = torch.empty(num_tokens, splits, dtype=torch.float32, device=hidden.device)
    part_idx = torch.empty(num_tokens, splits, dtype=torch.int32, device=hidden.device)
    mask = state.suppressed_mask
    precision, upcast = _dot_precision(hidden)
    _vocab_argmax_kernel[(token_blocks * splits,)](
        hidden, lm_head_weight, mask if mask is not None else out, part_val, part_idx,
        state.counters, out, num_tokens, hidden_size, hidden.stride(0),
        lm_head_weight.stride(0), splits, per_split, V=vocab,
        BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
        REDUCE_S=min(VOCAB_REDUCE_SPLITS, max(16, triton.next_power_of_2(splits))),
        HAS_SUPPRESSED=mask is not None, EVEN_K=hidden_size % cfg.block_k == 0,
        PRECISION=precision, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
