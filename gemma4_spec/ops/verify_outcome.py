"""What a verification step leaves for the next draft: each request's next token, how many of
its tokens were kept, and the row its drafting starts from.

After the target verifies a step, the V1 runner asks the drafter two things
(``prepare_next_token_ids_padded``, then ``prepare_inputs_padded``), each answered in vLLM by a
Triton launch from Python: ~50 us of host time each on the H200 machine, on a step the host
bounds at small batches (``benchmarks/results/h200``). Here the same two answers come from
launches replayed from CUDA graphs (``ops/graphed_launch.py``) into fixed output buffers.

``next_tokens_reference`` and ``draft_rows_reference`` are the definitions. For ``B`` requests,
``sampled [B, T]`` holds each request's verified tokens (rejected slots -1):

* ``kept[r]``: request r's tokens that are real ids (not -1, below ``vocab_size``); 0 if the
  request is discarded (a partial prefill whose sample is thrown away);
* ``next[r]``: the last real token of row r, or ``backup[r]`` (the request's last known token)
  if it is discarded or has none;
* with ``d[r]`` drafts (from the inclusive cumulative ``cu_drafts``), ``rejected[r] = d[r] + 1 -
  kept[r]`` if ``d[r] > 0`` else 0, and ``row[r] = query_start_loc[r + 1] - 1 - rejected[r]``:
  the flattened position of the request's last kept token.

``next_tokens`` and ``draft_rows`` write the same into caller-given outputs, one Triton launch
each; torch ops where Triton cannot run.
"""

from __future__ import annotations

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.graphed_launch import GraphedLaunches

if HAS_TRITON:
    import triton
    import triton.language as tl

ROWS_PER_PROGRAM = 64


def next_tokens_reference(
    sampled: torch.Tensor, discard: torch.Tensor, backup: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``next`` int32 ``[B]``, ``kept`` int32 ``[B]``) of ``sampled [B, T]``, ``discard [B]``
    (bool) and ``backup [B]``."""
    b, t = sampled.shape
    real = (sampled != -1) & (sampled < vocab_size)
    kept = real.sum(dim=1)
    slots = torch.arange(t, device=sampled.device).expand(b, t)
    last = torch.where(real, slots, -1).max(dim=1).values
    picked = sampled.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    drop = discard[:b] | (kept == 0)
    nxt = torch.where(drop, backup[:b].to(sampled.dtype), picked)
    kept = torch.where(discard[:b], 0, kept)
    return nxt.to(torch.int32), kept.to(torch.int32)


def draft_rows_reference(
    cu_drafts: torch.Tensor, kept: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``row`` int32 ``[R]``, ``rejected`` int32 ``[R]``) of ``R = num_reqs`` requests."""
    cu = cu_drafts[:num_reqs].long()
    drafts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    rejected = torch.where(drafts > 0, drafts + 1 - kept[:num_reqs].long(), 0)
    row = query_start_loc[1 : num_reqs + 1].long() - 1 - rejected
    return row.to(torch.int32), rejected.to(torch.int32)


def next_tokens(
    sampled: torch.Tensor,
    discard: torch.Tensor,
    backup: torch.Tensor,
    vocab_size: int,
    out_next: torch.Tensor,
    out_kept: torch.Tensor,
    launches: GraphedLaunches | None = None,
) -> None:
    """``next_tokens_reference`` into ``out_next[:B]`` and ``out_kept[:B]`` (int32). With
    ``launches``, a launch over tensors seen before replays its graph."""
    b, t = sampled.shape
    if sampled.stride(1) != 1:  # the kernel walks each row's slots one element apart
        sampled = sampled.contiguous()
    if not triton_usable(sampled.device):
        nxt, kept = next_tokens_reference(sampled, discard, backup, vocab_size)
        out_next[:b].copy_(nxt)
        out_kept[:b].copy_(kept)
        return

    def launch() -> None:
        _next_tokens_kernel[(triton.cdiv(b, ROWS_PER_PROGRAM),)](
            sampled, discard, backup, out_next, out_kept,
            b, t, sampled.stride(0), vocab_size,
            BLOCK_R=ROWS_PER_PROGRAM, BLOCK_T=triton.next_power_of_2(t),
        )  # fmt: skip

    if launches is None:
        launch()
        return
    key = (
        sampled.data_ptr(), discard.data_ptr(), backup.data_ptr(), out_next.data_ptr(),
        out_kept.data_ptr(), b, t, sampled.stride(0), vocab_size,
    )  # fmt: skip
    launches.run(key, launch, sampled.device)


def draft_rows(
    cu_drafts: torch.Tensor,
    kept: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    out_row: torch.Tensor,
    out_rejected: torch.Tensor,
    launches: GraphedLaunches | None = None,
) -> None:
    """``draft_rows_reference`` into ``out_row[:R]`` and ``out_rejected[:R]`` (int32)."""
    if not triton_usable(kept.device):
        row, rejected = draft_rows_reference(cu_drafts, kept, query_start_loc, num_reqs)
        out_row[:num_reqs].copy_(row)
        out_rejected[:num_reqs].copy_(rejected)
        return

    def launch() -> None:
        _draft_rows_kernel[(triton.cdiv(num_reqs, ROWS_PER_PROGRAM),)](
            cu_drafts, kept, query_start_loc, out_row, out_rejected, num_reqs,
            BLOCK_R=ROWS_PER_PROGRAM,
        )  # fmt: skip

    if launches is None:
        launch()
        return
    key = (
        cu_drafts.data_ptr(), kept.data_ptr(), query_start_loc.data_ptr(), out_row.data_ptr(),
        out_rejected.data_ptr(), num_reqs,
    )  # fmt: skip
    launches.run(key, launch, kept.device)


if HAS_TRITON:
    # Batch sizes vary step to step: no recompile per size class inside a live request.
    @triton.jit(do_not_specialize=["B"])
    def _next_tokens_kernel(
        sampled_ptr, discard_ptr, backup_ptr, next_ptr, kept_ptr,
        B, T, stride_sampled, vocab_size,
        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[pid * BLOCK_R, (pid + 1) * BLOCK_R)``, all their slots at once."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        s = tl.arange(0, BLOCK_T)
        r_ok = r < B
        ok = r_ok[:, None] & (s < T)[None, :]
        tok = tl.load(sampled_ptr + r[:, None].to(tl.int64) * stride_sampled + s[None, :],
                      mask=ok, other=-1)  # fmt: skip
        real = (tok != -1) & (tok < vocab_size) & ok
        kept = tl.sum(real.to(tl.int32), axis=1)
        last = tl.max(tl.where(real, s[None, :], -1), axis=1)
        picked = tl.sum(tl.where(s[None, :] == last[:, None], tok, 0), axis=1)
        discard = tl.load(discard_ptr + r, mask=r_ok, other=0) != 0
        backup = tl.load(backup_ptr + r, mask=r_ok, other=0)
        nxt = tl.where(discard | (kept == 0), backup.to(tl.int64), picked.to(tl.int64))
        tl.store(next_ptr + r, nxt.to(tl.int32), mask=r_ok)
        tl.store(kept_ptr + r, tl.where(discard, 0, kept), mask=r_ok)

    # Batch sizes vary step to step: no recompile per size class inside a live request.
    @triton.jit(do_not_specialize=["R"])
    def _draft_rows_kernel(
        cu_ptr, kept_ptr, qsl_ptr, row_ptr, rejected_ptr, R, BLOCK_R: tl.constexpr
    ):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < R
        cu = tl.load(cu_ptr + r, mask=r_ok, other=0)
        before = tl.load(cu_ptr + r - 1, mask=r_ok & (r > 0), other=0)
        drafts = cu - before
        kept = tl.load(kept_ptr + r, mask=r_ok, other=0)
        rejected = tl.where(drafts > 0, drafts + 1 - kept, 0)
        end = tl.load(qsl_ptr + r + 1, mask=r_ok, other=0)
        tl.store(row_ptr + r, (end - 1 - rejected).to(tl.int32), mask=r_ok)
        tl.store(rejected_ptr + r, rejected.to(tl.int32), mask=r_ok)
