"""The inputs of a replayed draft loop, staged in one launch.

A draft-loop CUDA graph (``spec_decode/draft_graphs.py``) reads its inputs from buffers of fixed
address: per row, the token id, the position and the target hidden state the first draft step
starts from, the row's sequence length, and its block-table row in each KV cache group the
draft layers read. Before every replay the batch's values go into those buffers; written as
torch ops that was ~15 small copies, index gathers and fills, each a kernel launch with its
Python dispatch on the host, on the critical path of a step that is bound by the host at small
batches (H200, E2B shapes: ``benchmarks/results/h200``).

``stage_draft_inputs_reference`` is the definition. For ``B`` requests drafted as ``S >= B``
rows (the graph's size), from the target step's ``positions [N]`` and ``hidden [N, H]``, the
row of each request's last accepted token ``rows [B]``, the token it drafts from
``next_token_ids [B]``, its key count ``seq_lens [B]`` (less ``rejected [B]``, the tokens of
the step the target rejected, whose K/V are still in the cache) and its block-table rows:

* rows ``r < B``: ``input_ids[r] = next_token_ids[r]``, ``positions[r] = positions[rows[r]]``,
  ``hidden[r] = hidden[rows[r]]``, ``seq_lens[r] = seq_lens[r] - rejected[r]``,
  ``tables[g][r] = tables_g[r]``;
* padding rows ``B <= r < S``: a request of one key on the null block: token 0 at position 0,
  zero hidden state, ``seq_lens[r] = 1``, ``tables[g][r] = 0``.

``stage_runner_v2_inputs`` is the same staging from what Model Runner V2 hands its speculator
(``RunnerV2Step``): each request's last accepted row and the token it drafts from are derived
on the GPU (``draft_sources_of`` defines how), no block tables are copied (V2 keeps them at
fixed addresses), padding rows get no keys (``seq_lens = 0``, as V2 pads), and the one-query
``query_start_loc`` of the draft batch is written too.

``stage_draft_inputs`` writes the same into the buffers in one Triton launch (one more per two
further KV cache groups), reading everything on the GPU: no host synchronisation. Given a
``GraphedLaunches``, a launch over tensors it has seen before is replayed from a CUDA graph
(``ops/graphed_launch.py``), which spares the host Triton's dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.graphed_launch import GraphedLaunches

if HAS_TRITON:
    import triton
    import triton.language as tl

NULL_BLOCK_ID = 0  # vLLM reserves block 0 for padding
TABLES_PER_LAUNCH = 2
STAGE_BLOCK = 1024  # hidden / block-table elements per inner step of a program


@dataclass(frozen=True)
class DraftStepSources:
    """One target step's tensors the first draft step starts from (all on one device)."""

    next_token_ids: torch.Tensor  # [>= B]
    positions: torch.Tensor  # [N]
    hidden: torch.Tensor  # [N, H]
    rows: torch.Tensor  # [>= B]: each request's last accepted token in positions / hidden
    seq_lens: torch.Tensor  # [>= B]
    rejected: torch.Tensor | None  # [>= B] or None (nothing rejected)
    tables: tuple[torch.Tensor, ...]  # per KV cache group: [>= B, W_g]


@dataclass(frozen=True)
class DraftStepBuffers:
    """The fixed-address inputs of a draft-loop graph (at least ``S`` rows each)."""

    input_ids: torch.Tensor  # [cap]
    positions: torch.Tensor  # [cap]
    hidden: torch.Tensor  # [cap, H]
    seq_lens: torch.Tensor  # [cap]
    tables: tuple[torch.Tensor, ...]  # per KV cache group: [cap, W_g]


@dataclass(frozen=True)
class RunnerV2Step:
    """What Model Runner V2 hands its speculator after a target step of ``B`` requests."""

    query_start_loc: torch.Tensor  # [>= B + 1]: each request's tokens in the step
    seq_lens: torch.Tensor  # [>= B]: keys after the step, rejected tokens included
    positions: torch.Tensor  # [N]
    hidden: torch.Tensor  # [N, H]
    idx_mapping: torch.Tensor  # [>= B]: batch row -> request-state row
    num_sampled: torch.Tensor  # [>= B]: 0 for a prompt chunk that samples nothing
    rejected: torch.Tensor  # [>= B]
    last_sampled: torch.Tensor  # [R, 1] (vLLM's) or [R]: per request state, its last sampled token
    next_prefill_tokens: torch.Tensor  # [R]: per request state, its next prompt token


def draft_sources_of(step: RunnerV2Step, batch_size: int) -> DraftStepSources:
    """The definition of the derivation: a request's last accepted row is its last token in
    the step less the rejected ones; it drafts from its last sampled token, or from its next
    prompt token while its prompt is still being prefilled."""
    b = batch_size
    rows = step.query_start_loc[1 : b + 1] - 1 - step.rejected[:b]
    state = step.idx_mapping[:b].long()
    next_ids = torch.where(
        step.num_sampled[:b] > 0,
        step.last_sampled.reshape(-1)[state].to(torch.int32),
        step.next_prefill_tokens[state].to(torch.int32),
    )
    return DraftStepSources(
        next_token_ids=next_ids,
        positions=step.positions,
        hidden=step.hidden,
        rows=rows,
        seq_lens=step.seq_lens,
        rejected=step.rejected,
        tables=(),
    )


def stage_runner_v2_inputs_reference(
    step: RunnerV2Step, batch_size: int, size: int
) -> tuple[DraftStepBuffers, torch.Tensor]:
    """The staged rows and the draft batch's ``query_start_loc [size + 1]``, as new tensors."""
    staged = stage_draft_inputs_reference(
        draft_sources_of(step, batch_size), batch_size, size, pad_seq_len=0
    )
    starts = torch.arange(size + 1, dtype=torch.int32).clamp(max=batch_size)
    return staged, starts.to(step.query_start_loc.device)


def stage_draft_inputs_reference(
    src: DraftStepSources, batch_size: int, size: int, pad_seq_len: int = 1
) -> DraftStepBuffers:
    """The first ``size`` rows of every staged buffer, as new tensors (padding rows with
    ``pad_seq_len`` keys)."""
    b, pad = batch_size, size - batch_size
    rows = src.rows[:b].long()
    seq_lens = src.seq_lens[:b]
    if src.rejected is not None:
        seq_lens = seq_lens - src.rejected[:b]

    def padded(real: torch.Tensor, fill: int) -> torch.Tensor:
        tail = real.new_full((pad, *real.shape[1:]), fill)
        return torch.cat([real, tail])

    return DraftStepBuffers(
        input_ids=padded(src.next_token_ids[:b], 0),
        positions=padded(src.positions[rows], 0),
        hidden=padded(src.hidden[rows], 0),
        seq_lens=padded(seq_lens, pad_seq_len),
        tables=tuple(padded(table[:b], NULL_BLOCK_ID) for table in src.tables),
    )


def stage_draft_inputs(
    src: DraftStepSources,
    out: DraftStepBuffers,
    batch_size: int,
    size: int,
    launches: GraphedLaunches | None = None,
) -> None:
    """``stage_draft_inputs_reference`` into the first ``size`` rows of ``out``. Block-table
    rows are copied up to the narrower of source and buffer (entries past a row's sequence are
    never read). Torch ops where Triton cannot run. With ``launches``, ``out`` must be the same
    buffers at every call (graphs replay into them)."""
    _check(src, out, batch_size, size)
    if not triton_usable(out.hidden.device):
        want = stage_draft_inputs_reference(src, batch_size, size)
        for name in ("input_ids", "positions", "hidden", "seq_lens"):
            getattr(out, name)[:size].copy_(getattr(want, name))
        for table, rows in zip(out.tables, want.tables, strict=True):
            width = min(table.shape[1], rows.shape[1])
            table[:size, :width].copy_(rows[:, :width])
        return
    if launches is None:
        _launch_stage(src, out, batch_size, size)
        return
    # Everything the launches bake in but the outputs (the caller's fixed buffers).
    key = (
        batch_size, size, src.hidden.stride(0), src.rejected is None,
        src.next_token_ids.data_ptr(), src.positions.data_ptr(), src.hidden.data_ptr(),
        src.rows.data_ptr(), src.seq_lens.data_ptr(),
        None if src.rejected is None else src.rejected.data_ptr(),
        *((t.data_ptr(), t.stride(0), t.shape[1]) for t in src.tables),
    )  # fmt: skip
    launches.run(key, lambda: _launch_stage(src, out, batch_size, size), out.hidden.device)


def stage_runner_v2_inputs(
    step: RunnerV2Step,
    out: DraftStepBuffers,
    query_start_loc: torch.Tensor,
    batch_size: int,
    size: int,
) -> None:
    """``stage_runner_v2_inputs_reference`` into the first ``size`` rows of ``out`` (which has
    no tables) and ``query_start_loc[: size + 1]``, in one launch (torch ops where Triton
    cannot run)."""
    if out.tables:
        raise ValueError("Model Runner V2 keeps its block tables: stage none")
    if query_start_loc.shape[0] < size + 1:
        raise ValueError(f"query_start_loc holds {query_start_loc.shape[0]} of {size + 1} entries")
    if step.last_sampled.stride(0) != 1 or step.last_sampled[0].numel() != 1:
        raise ValueError("last_sampled needs one token per request state, states adjacent")
    # The kernel's V2 mode reads two fields differently (its docstring says how): the rows and
    # tokens are derived in the kernel from the step's query_start_loc and per-state tokens.
    sources = DraftStepSources(
        next_token_ids=step.last_sampled,
        positions=step.positions,
        hidden=step.hidden,
        rows=step.query_start_loc,
        seq_lens=step.seq_lens,
        rejected=step.rejected,
        tables=(),
    )
    _check(sources, out, batch_size, size)
    if not triton_usable(out.hidden.device):
        staged, starts = stage_runner_v2_inputs_reference(step, batch_size, size)
        for name in ("input_ids", "positions", "hidden", "seq_lens"):
            getattr(out, name)[:size].copy_(getattr(staged, name))
        query_start_loc[: size + 1].copy_(starts)
        return
    _launch_stage(sources, out, batch_size, size, derive=(step, query_start_loc))


def _launch_stage(
    src: DraftStepSources,
    out: DraftStepBuffers,
    batch_size: int,
    size: int,
    derive: tuple[RunnerV2Step, torch.Tensor] | None = None,
) -> None:
    rejected = src.rejected if src.rejected is not None else src.seq_lens
    pairs = list(zip(src.tables, out.tables, strict=True))
    # The first launch stages the rows and two tables; each further one two more tables.
    for start in range(0, max(len(pairs), 1), TABLES_PER_LAUNCH):
        chunk = pairs[start : start + TABLES_PER_LAUNCH]
        t_args: list[object] = []
        for i in range(TABLES_PER_LAUNCH):
            if i < len(chunk):
                s, d = chunk[i]
                t_args += [s, d, min(s.shape[1], d.shape[1]), s.stride(0), d.stride(0)]
            else:  # unused slot: any int32 tensor, width 0
                t_args += [out.seq_lens, out.seq_lens, 0, 0, 0]
        if derive is None:  # unused: any int32 tensors
            d_args = [out.seq_lens] * 4
        else:
            step, starts = derive
            d_args = [step.num_sampled, step.idx_mapping, step.next_prefill_tokens, starts]
        _stage_kernel[(size,)](
            src.next_token_ids, src.positions, src.hidden, src.rows, src.seq_lens, rejected,
            out.input_ids, out.positions, out.hidden, out.seq_lens,
            *t_args,
            *d_args,
            batch_size, src.hidden.shape[1], src.hidden.stride(0), out.hidden.stride(0),
            DO_ROWS=start == 0, HAS_REJECTED=src.rejected is not None, NUM_TABLES=len(chunk),
            DERIVE=derive is not None, PAD_SEQ=0 if derive is not None else 1,
            BLOCK=STAGE_BLOCK,
        )  # fmt: skip


def _check(src: DraftStepSources, out: DraftStepBuffers, batch_size: int, size: int) -> None:
    if not 0 < batch_size <= size:
        raise ValueError(f"need 0 < batch_size <= size, got {batch_size} and {size}")
    if size > out.seq_lens.shape[0]:
        raise ValueError(f"{size} rows exceed the buffers' {out.seq_lens.shape[0]}")
    if src.hidden.shape[1] != out.hidden.shape[1]:
        raise ValueError(
            f"hidden width {src.hidden.shape[1]} does not match the buffer's {out.hidden.shape[1]}"
        )
    if len(src.tables) != len(out.tables):
        raise ValueError(f"{len(src.tables)} block tables for {len(out.tables)} buffers")
    for t in (src.hidden, out.hidden, *src.tables, *out.tables):
        if t.stride(-1) != 1:
            raise ValueError("hidden states and block tables need contiguous rows")


if HAS_TRITON:

    @triton.jit
    def _copy_row(src_ptr, dst_ptr, n, n_read, BLOCK: tl.constexpr):
        """``dst[:n] = src[:n]`` with ``src`` read up to ``n_read`` (``n`` or 0) and zeros
        after it."""
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            vals = tl.load(src_ptr + offs, mask=offs < n_read, other=0)
            tl.store(dst_ptr + offs, vals, mask=offs < n)

    # Batch sizes vary step to step: no recompile per size class inside a live request.
    @triton.jit(do_not_specialize=["B"])
    def _stage_kernel(
        next_ids_ptr, src_pos_ptr, src_hidden_ptr, rows_ptr, src_seq_ptr, rejected_ptr,
        ids_ptr, pos_ptr, hidden_ptr, seq_ptr,
        src_t0, dst_t0, w0, s_src0, s_dst0,
        src_t1, dst_t1, w1, s_src1, s_dst1,
        sampled_ptr, idx_ptr, prefill_ptr, starts_ptr,
        B, H, stride_src_hidden, stride_hidden,
        DO_ROWS: tl.constexpr,
        HAS_REJECTED: tl.constexpr,
        NUM_TABLES: tl.constexpr,
        DERIVE: tl.constexpr,
        PAD_SEQ: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program r stages row r (a padding row when r >= B). With ``DERIVE`` (Model Runner
        V2), ``rows_ptr`` is the step's query_start_loc, ``next_ids_ptr`` the per-state last
        sampled tokens, and the draft batch's query_start_loc goes to ``starts_ptr``."""
        r = tl.program_id(0)
        real = r < B
        keep = real.to(tl.int32)  # 1: copy the row, 0: zeros
        if DO_ROWS:
            if real:
                if DERIVE:
                    row = (tl.load(rows_ptr + r + 1) - 1 - tl.load(rejected_ptr + r)).to(tl.int64)
                    state = tl.load(idx_ptr + r).to(tl.int64)
                    if tl.load(sampled_ptr + r) > 0:
                        token = tl.load(next_ids_ptr + state).to(tl.int32)
                    else:
                        token = tl.load(prefill_ptr + state).to(tl.int32)
                    tl.store(ids_ptr + r, token)
                else:
                    row = tl.load(rows_ptr + r).to(tl.int64)
                    tl.store(ids_ptr + r, tl.load(next_ids_ptr + r))
                tl.store(pos_ptr + r, tl.load(src_pos_ptr + row))
                seq = tl.load(src_seq_ptr + r)
                if HAS_REJECTED:
                    seq -= tl.load(rejected_ptr + r)
                tl.store(seq_ptr + r, seq)
            else:
                row = r.to(tl.int64) * 0
                tl.store(ids_ptr + r, 0)
                tl.store(pos_ptr + r, 0)
                tl.store(seq_ptr + r, PAD_SEQ)
            _copy_row(
                src_hidden_ptr + row * stride_src_hidden,
                hidden_ptr + r.to(tl.int64) * stride_hidden,
                H, H * keep, BLOCK,
            )  # fmt: skip
            if DERIVE:
                tl.store(starts_ptr + r, tl.minimum(r, B))
                if r == tl.num_programs(0) - 1:
                    tl.store(starts_ptr + r + 1, B)
        if NUM_TABLES > 0:
            _copy_row(src_t0 + r * s_src0, dst_t0 + r * s_dst0, w0, w0 * keep, BLOCK)
        if NUM_TABLES > 1:
            _copy_row(src_t1 + r * s_src1, dst_t1 + r * s_dst1, w1, w1 * keep, BLOCK)
