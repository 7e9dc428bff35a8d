"""Greedy verification: which drafts the target accepts, and the token it adds.

A verification step scores, for request ``i`` with ``n_i`` drafts, ``n_i + 1`` logits rows in a
row: one before each draft and one after the last (the bonus row). Rows are numbered over all
requests in order, so request ``i`` starts at row ``D_i + i``, where ``D_i`` is the number of
drafts of the requests before it (``cu_num_draft_tokens[i - 1]``).

``greedy_verify_reference`` is the definition. ``best`` holds the target's greedy token of every
row. Request ``i`` takes its rows' tokens, in order, while they equal its drafts; the first
token that differs is taken too (the target's correction) and ends the request's tokens; if
every draft matched, the bonus row's token follows them. Output ``[R, max_drafts + 1]`` int32,
``-1`` after each request's last token. This is what vLLM's rejection sampler outputs for an
all-greedy batch with nothing that changes the logits (``patch/patch_rejection_sampler.py``
checks that).

``greedy_verify`` is the same in one Triton launch on CUDA (the reference elsewhere).

``greedy_verify_rows_reference`` defines the same for Model Runner V2's layout, where request
``i`` owns logits rows ``cu_num_logits[i]`` to ``cu_num_logits[i + 1] - 1`` and the draft that
row ``r`` scores (every row of a request but its last) is the token fed at row ``r + 1``'s
position, ``input_ids[logits_indices[r + 1]]``. It outputs ``[R, width]`` int64 (``-1`` after
each request's last token) and each request's token count ``[R]`` int32, as V2's rejection
sampler does for an all-greedy batch (``patch/patch_v2_rejection_sampler.py`` checks that);
``greedy_verify_rows`` is one Triton launch.

With synthetic acceptance (vLLM's ``rejection_sample_method: "synthetic"``, a benchmark mode
for random weights), a draft is not compared with the argmax: draft ``j`` of a request is kept
while every draft before it was, it is a real token (not vLLM's ``-1`` placeholder) and a
uniform draw ``u`` is below the configured conditional rate of position ``j``. A kept draft is
output as itself, the first one not kept is replaced by its row's token, and a request that
keeps all its drafts adds its bonus row's token, as in greedy verification. Model Runner V2
draws ``u`` for the row at position ``p`` of a request with seed ``s`` as Triton's
``rand(s, p)``, raised to at least ``2**-31``; ``greedy_verify_rows`` draws the same, so its
tokens are V2's own (``tests/test_v2_greedy_verify.py`` compares them).
``greedy_verify_rows_reference`` takes the draws as ``uniforms``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable

if HAS_TRITON:
    import triton
    import triton.language as tl

# vLLM's placeholder for "no token" in its sampled-token output.
NO_TOKEN = -1


def greedy_verify_reference(
    best: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_drafts: int,
) -> torch.Tensor:
    """``best`` [sum(n_i + 1)] the target's token per logits row, ``draft_token_ids``
    [sum(n_i)], ``cu_num_draft_tokens`` [R]: each request's tokens ``[R, max_drafts + 1]``."""
    ends = cu_num_draft_tokens.tolist()
    best_list, drafts = best.tolist(), draft_token_ids.tolist()
    out = torch.full((len(ends), max_drafts + 1), NO_TOKEN, dtype=torch.int32)
    start = 0
    for i, end in enumerate(ends):
        row = start + i
        for j in range(end - start + 1):
            out[i, j] = best_list[row + j]
            if j == end - start or drafts[start + j] != best_list[row + j]:
                break
        start = end
    return out.to(best.device)


def greedy_verify(
    best: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_drafts: int,
) -> torch.Tensor:
    """``greedy_verify_reference``, in one launch where Triton runs."""
    if not triton_usable(best.device):
        return greedy_verify_reference(best, draft_token_ids, cu_num_draft_tokens, max_drafts)
    num_reqs = cu_num_draft_tokens.shape[0]
    out = torch.empty((num_reqs, max_drafts + 1), dtype=torch.int32, device=best.device)
    _verify_kernel[(num_reqs,)](
        best, draft_token_ids, cu_num_draft_tokens, out, max_drafts + 1,
        BLOCK=triton.next_power_of_2(max_drafts + 1),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class SyntheticAcceptance:
    """What a synthetic-acceptance verification draws from: ``rates`` [k] float32 the
    conditional acceptance rate of each draft position, ``seeds`` [max_reqs] int64 and
    ``idx_mapping`` [R] int32 each request's seed (by its state index), ``positions`` the
    step's token positions (read at ``logits_indices``)."""

    rates: torch.Tensor
    seeds: torch.Tensor
    idx_mapping: torch.Tensor
    positions: torch.Tensor


def greedy_verify_rows_reference(
    best: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    cu_num_logits: torch.Tensor,
    width: int,
    rates: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``best`` [rows] the target's token per logits row; the drafts are read from
    ``input_ids`` at ``logits_indices``: (tokens ``[R, width]``, counts ``[R]``). With
    ``rates`` [k] and ``uniforms`` [rows] (each row's draw), synthetic acceptance."""
    cu, best_list = cu_num_logits.tolist(), best.tolist()
    where, ids = logits_indices.tolist(), input_ids.tolist()
    synthetic = rates is not None and uniforms is not None
    rate, draw = (rates.tolist(), uniforms.tolist()) if synthetic else ([], [])  # type: ignore[union-attr]
    num_reqs = len(cu) - 1
    out = torch.full((num_reqs, width), NO_TOKEN, dtype=torch.int64)
    counts = torch.zeros(num_reqs, dtype=torch.int32)
    for i in range(num_reqs):
        start, rows = cu[i], cu[i + 1] - cu[i]
        for j in range(rows):
            counts[i] = j + 1
            if j == rows - 1:  # the bonus row, or a row that scores no draft
                out[i, j] = best_list[start + j]
                break
            draft = ids[where[start + j + 1]]
            if synthetic:
                kept = draft >= 0 and draw[start + j] < rate[j]
            else:
                kept = draft == best_list[start + j]
            out[i, j] = draft if kept else best_list[start + j]
            if not kept:
                break
    return out.to(best.device), counts.to(best.device)


def greedy_verify_rows(
    best: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    cu_num_logits: torch.Tensor,
    width: int,
    synthetic: SyntheticAcceptance | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_verify_rows_reference``, in one launch where Triton runs; with ``synthetic``,
    synthetic acceptance with V2's own draws (only where Triton runs: it draws them)."""
    if not triton_usable(best.device):
        if synthetic is not None:
            raise ValueError("synthetic acceptance draws its uniforms with Triton")
        return greedy_verify_rows_reference(best, input_ids, logits_indices, cu_num_logits, width)
    num_reqs = cu_num_logits.shape[0] - 1
    out = torch.empty((num_reqs, width), dtype=torch.int64, device=best.device)
    counts = torch.empty(num_reqs, dtype=torch.int32, device=best.device)
    # Unused pointers where acceptance is compared (any tensor of the device will do).
    rates, seeds, idx, positions = (
        (synthetic.rates, synthetic.seeds, synthetic.idx_mapping, synthetic.positions)
        if synthetic is not None
        else (best, best, best, best)
    )
    _verify_rows_kernel[(num_reqs,)](
        best, input_ids, logits_indices, cu_num_logits, out, counts, width,
        rates, seeds, idx, positions,
        BLOCK=triton.next_power_of_2(width), SYNTHETIC=synthetic is not None,
    )  # fmt: skip
    return out, counts


def compile_greedy_verify_rows(
    device: torch.device, width: int, synthetic_rates: torch.Tensor | None = None
) -> None:
    """Compiles ``greedy_verify_rows``' kernel for the argument types Model Runner V2 passes
    (int64 argmax and logits indices, int32 input ids and offsets; with ``synthetic_rates``,
    the synthetic-acceptance variant), so that an engine's first greedy request does not
    (vLLM's start-up warm-up samples, and never takes this path)."""
    if not triton_usable(device):
        return
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    offsets = torch.tensor([0, 1], dtype=torch.int32, device=device)
    ids = torch.zeros(2, dtype=torch.int32, device=device)
    synthetic = None
    if synthetic_rates is not None:
        idx = torch.zeros(1, dtype=torch.int32, device=device)
        synthetic = SyntheticAcceptance(synthetic_rates, rows, idx, rows)
    greedy_verify_rows(rows, ids, rows, offsets, width, synthetic)


if HAS_TRITON:
    # Below any draw of ``tl.rand``: V2's floor for its uniforms (2 ** -31).
    _RAND_FLOOR = tl.constexpr(4.6566127342e-10)

    @triton.jit
    def _verify_rows_kernel(
        best_ptr, ids_ptr, where_ptr, cu_ptr, out_ptr, counts_ptr, width,
        rates_ptr, seeds_ptr, idx_ptr, pos_ptr,
        BLOCK: tl.constexpr, SYNTHETIC: tl.constexpr,
    ):  # fmt: skip
        """Program i: request i's tokens and their count."""
        i = tl.program_id(0)
        start = tl.load(cu_ptr + i)
        rows = tl.load(cu_ptr + i + 1) - start
        j = tl.arange(0, BLOCK)
        token = tl.load(best_ptr + start + j, mask=j < rows, other=-1)
        scores_draft = j < rows - 1
        at = tl.load(where_ptr + start + 1 + j, mask=scores_draft, other=0)
        draft = tl.load(ids_ptr + at, mask=scores_draft, other=-1).to(tl.int64)
        if SYNTHETIC:
            seed = tl.load(seeds_ptr + tl.load(idx_ptr + i))
            row_at = tl.load(where_ptr + start + j, mask=scores_draft, other=0)
            pos = tl.load(pos_ptr + row_at, mask=scores_draft, other=0)
            u = tl.maximum(tl.rand(seed, pos), _RAND_FLOOR)
            rate = tl.load(rates_ptr + j, mask=scores_draft, other=0.0)
            miss = scores_draft & ((draft < 0) | (u >= rate))
        else:
            miss = scores_draft & (draft != token)
        # Rows 0..m are kept, m = the first row whose draft is not (or the last row); a kept
        # draft is output as itself (greedy: it equals the row's token), row m as its token.
        first_miss = tl.min(tl.where(miss, j, rows - 1), axis=0)
        out = tl.where(j < first_miss, draft, tl.where(j == first_miss, token, -1))
        tl.store(out_ptr + i * width + j, out, mask=j < width)
        tl.store(counts_ptr + i, first_miss + 1)

    @triton.jit
    def _verify_kernel(best_ptr, drafts_ptr, cu_drafts_ptr, out_ptr, width, BLOCK: tl.constexpr):
        """Program i: request i's row of the output (-1: no token, as NO_TOKEN)."""
        i = tl.program_id(0)
        start = tl.load(cu_drafts_ptr + i - 1, mask=i > 0, other=0)
        n = tl.load(cu_drafts_ptr + i) - start
        j = tl.arange(0, BLOCK)
        is_row = j <= n
        token = tl.load(best_ptr + start + i + j, mask=is_row, other=-1)
        draft = tl.load(drafts_ptr + start + j, mask=j < n, other=-1)
        # Draft j is kept while it and every draft before it match; the tokens kept are rows
        # 0..m, m = the first mismatch (or n, the bonus row, if none).
        miss = (j < n) & (draft != token)
        first_miss = tl.min(tl.where(miss, j, n), axis=0)
        keep = j <= first_miss
        tl.store(out_ptr + i * width + j, tl.where(keep, token, -1), mask=j < width)
