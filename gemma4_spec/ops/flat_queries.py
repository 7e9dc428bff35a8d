"""Verification batches as single-query sequences, for decode attention kernels.

A speculative verification step gives each request ``1 + k`` query tokens at the end of its
sequence. Causal attention lets the token at position ``p`` see keys ``0..p`` and nothing
after, so the step is the same attention as ``1 + k`` one-token "sequences" per request, the
``j``-th ending where that token sits: key length ``seq_len - (q_len - 1 - j)``, the request's
block table. Decode kernels handle one-token sequences better than multi-token ones:
vLLM's Triton attention splits each one-token sequence's keys over several programs (its "3D"
path) but runs a request with ``q_len > 1`` in one program per KV head ("2D"), which left the
H200 idle at small batches (16 vs 7.5 us per layer, E2B shapes, batch 1, k = 2).

``flatten_queries_reference`` is the definition. Given a batch's ``query_start_loc`` ``[R + 1]``
(padded requests repeat the last value), ``seq_lens`` ``[R]`` and ``block_table`` ``[R, W]``,
and ``N`` query tokens (padding included), token ``i`` becomes sequence ``i``:

* ``query_start_loc_flat[i] = min(i, total)``, ``total = query_start_loc[R]``: one query per
  real token, none for the padding tokens after them;
* ``seq_lens_flat[i] = seq_lens[r] - (query_start_loc[r + 1] - 1 - i)`` for token ``i`` of
  request ``r``, 0 for padding;
* ``block_table_flat[i] = block_table[r]`` (padding: the last request's row; never read, as
  its length is 0).

``flatten_queries`` writes the same into preallocated buffers in one Triton launch (no host
synchronisation, CUDA-graph capturable), reading the step's tensors on the GPU. The runner hands
every step the same input buffers, so the launch is replayed from a CUDA graph after its first
use (``ops/graphed_launch.py``), which spares the host Triton's dispatch.
"""

from __future__ import annotations

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.graphed_launch import GraphedLaunches

if HAS_TRITON:
    import triton
    import triton.language as tl


def flatten_queries_reference(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start_loc ``[N + 1]``, seq_lens ``[N]``, block_table ``[N, W]``) of the batch
    with each of its ``N = num_tokens`` query tokens as its own sequence."""
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc[: num_reqs + 1].long()
    total = int(qsl[-1])
    tokens = torch.arange(num_tokens, device=qsl.device)
    request = torch.searchsorted(qsl[1:], tokens, right=True).clamp(max=num_reqs - 1)
    after = qsl[request + 1] - 1 - tokens  # query tokens of the request after this one
    lens = seq_lens.long()[request] - after
    lens = torch.where(tokens < total, lens, 0).clamp(min=0)
    starts = torch.cat([tokens.clamp(max=total), tokens.new_tensor([total])])
    return (
        starts.to(query_start_loc.dtype),
        lens.to(seq_lens.dtype),
        block_table[request],
    )


FLAT_BLOCK_W = 256  # block-table entries per program


class FlatQueryBuffers:
    """Fixed-address outputs of ``flatten_queries`` for up to ``capacity`` tokens (a CUDA
    graph captured over them stays valid while their contents change)."""

    def __init__(self, capacity: int, width: int, device: torch.device) -> None:
        self.capacity = capacity
        self.width = width
        self.query_start_loc = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(capacity, width, dtype=torch.int32, device=device)
        self.launches = GraphedLaunches("query flattening")
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc ``[N + 1]``, seq_lens ``[N]``, block_table ``[N, W]``) of
        ``N = num_tokens`` rows, made once per ``N`` (slicing costs the host every step)."""
        views = self._views.get(num_tokens)
        if views is None:
            views = (
                self.query_start_loc[: num_tokens + 1],
                self.seq_lens[:num_tokens],
                self.block_table[:num_tokens],
            )
            self._views[num_tokens] = views
        return views


def flatten_queries(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    out: FlatQueryBuffers,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flatten_queries_reference`` into ``out`` (returned as views of ``num_tokens`` rows).
    Block-table rows are copied up to ``out.width`` entries (the buffers are sized for the
    longest sequence, so entries past it are never read). Torch ops where Triton cannot run."""
    if num_tokens > out.capacity:
        raise ValueError(f"{num_tokens} tokens exceed the buffers' capacity {out.capacity}")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError("block_table must be int32 with contiguous rows")
    num_reqs = seq_lens.shape[0]
    starts, lens, table = out.views(num_tokens)
    width = min(out.width, block_table.shape[1])
    if not triton_usable(block_table.device):
        ref = flatten_queries_reference(query_start_loc, seq_lens, block_table, num_tokens)
        starts.copy_(ref[0])
        lens.copy_(ref[1])
        table[:, :width].copy_(ref[2][:, :width])
        return starts, lens, table

    def launch() -> None:
        _flatten_kernel[(num_tokens + 1, triton.cdiv(width, FLAT_BLOCK_W))](
            query_start_loc, seq_lens, block_table, starts, lens, table,
            num_reqs, num_tokens, width, block_table.stride(0), table.stride(0),
            BLOCK_R=max(16, triton.next_power_of_2(num_reqs + 1)), BLOCK_W=FLAT_BLOCK_W,
        )  # fmt: skip

    # Everything the launch bakes in (the outputs are ``out``'s own buffers, always the same).
    key = (
        query_start_loc.data_ptr(), seq_lens.data_ptr(), block_table.data_ptr(),
        block_table.stride(0), num_reqs, num_tokens, width,
    )  # fmt: skip
    out.launches.run(key, launch, block_table.device)
    return starts, lens, table


if HAS_TRITON:
    # Batch sizes vary step to step: no recompile per size class inside a live request.
    @triton.jit(do_not_specialize=["R", "N"])
    def _flatten_kernel(
        qsl_ptr,  # [R + 1] int32
        seq_lens_ptr,  # [R] int32
        table_ptr,  # [R, W] int32
        qsl_out_ptr,  # [N + 1] int32
        seq_lens_out_ptr,  # [N] int32
        table_out_ptr,  # [N, W] int32
        R,
        N,
        W,
        stride_table,
        stride_table_out,
        BLOCK_R: tl.constexpr,  # > R
        BLOCK_W: tl.constexpr,
    ):
        """Program (i, w): token i's sequence (i = N writes the final start only) and block
        ``w`` of its block-table row."""
        i = tl.program_id(0)
        w = tl.program_id(1)
        offs_r = tl.arange(0, BLOCK_R)
        ends = tl.load(qsl_ptr + 1 + offs_r, mask=offs_r < R, other=2**30)
        total = tl.load(qsl_ptr + R)
        if w == 0:
            tl.store(qsl_out_ptr + i, tl.minimum(i, total))
        if i < N:
            request = tl.minimum(tl.sum((ends <= i).to(tl.int32), axis=0), R - 1)
            end = tl.load(qsl_ptr + request + 1)
            length = tl.load(seq_lens_ptr + request) - (end - 1 - i)
            length = tl.where(i < total, tl.maximum(length, 0), 0)
            if w == 0:
                tl.store(seq_lens_out_ptr + i, length)
            offs_w = w * BLOCK_W + tl.arange(0, BLOCK_W)
            w_ok = offs_w < W
            row = tl.load(table_ptr + request * stride_table + offs_w, mask=w_ok)
            tl.store(table_out_ptr + i * stride_table_out + offs_w, row, mask=w_ok)
