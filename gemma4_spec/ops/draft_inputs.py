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


def stage_draft_inputs_reference(
    src: DraftStepSources, batch_size: int, size: int
) -> DraftStepBuffers:
    """The first ``size`` rows of every staged buffer, as new tensors."""
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
        seq_lens=padded(seq_lens, 1),
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


def _launch_stage(src: DraftStepSources, out: DraftStepBuffers, batch_size: int, size: int) -> None:
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
        _stage_kernel[(size,)](
            src.next_token_ids, src.positions, src.hidden, src.rows, src.seq_lens, rejected,
            out.input_ids, out.positions, out.hidden, out.seq_lens,
            *t_args,
            batch_size, src.hidden.shape[1], src.hidden.stride(0), out.hidden.stride(0),
            DO_ROWS=start == 0, HAS_REJECTED=src.rejected is not None, NUM_TABLES=len(chunk),
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
        B, H, stride_src_hidden, stride_hidden,
        DO_ROWS: tl.constexpr,
        HAS_REJECTED: tl.constexpr,
        NUM_TABLES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Program r stages row r (a padding row when r >= B)."""
        r = tl.program_id(0)
        real = r < B
        keep = real.to(tl.int32)  # 1: copy the row, 0: zeros
        if DO_ROWS:
            if real:
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
                tl.store(seq_ptr + r, 1)
            _copy_row(
                src_hidden_ptr + row * stride_src_hidden,
                hidden_ptr + r.to(tl.int64) * stride_hidden,
                H, H * keep, BLOCK,
            )  # fmt: skip
        if NUM_TABLES > 0:
            _copy_row(src_t0 + r * s_src0, dst_t0 + r * s_dst0, w0, w0 * keep, BLOCK)
        if NUM_TABLES > 1:
            _copy_row(src_t1 + r * s_src1, dst_t1 + r * s_dst1, w1, w1 * keep, BLOCK)
