"""``gemma4_spec.ops.flat_queries``: the reference against hand-worked batches, the Triton
kernel against the reference (on CUDA, or on CPU under Triton's interpreter in a subprocess)."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.flat_queries import (
    FlatQueryBuffers,
    flatten_queries,
    flatten_queries_reference,
)


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_reference_uniform_verification_batch() -> None:
    # Two requests of 3 query tokens (k = 2), 10 and 7 keys including their query tokens.
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    starts, lens, rows = flatten_queries_reference(_i32(0, 3, 6), _i32(10, 7), table, 6)
    assert starts.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert lens.tolist() == [8, 9, 10, 5, 6, 7]
    assert rows.tolist() == [table[0].tolist()] * 3 + [table[1].tolist()] * 3


def test_reference_padding_and_uneven_requests() -> None:
    # Request 0 has 1 query token, request 1 has 3; a padded request (repeated start, length
    # 0) and two padding tokens follow: they become empty sequences.
    table = torch.tensor([[5, 6], [7, 8], [0, 0]], dtype=torch.int32)
    starts, lens, rows = flatten_queries_reference(_i32(0, 1, 4, 4), _i32(4, 9, 0), table, 6)
    assert starts.tolist() == [0, 1, 2, 3, 4, 4, 4]
    assert lens.tolist() == [4, 7, 8, 9, 0, 0]
    assert rows[:4].tolist() == [[5, 6], [7, 8], [7, 8], [7, 8]]
    assert starts.dtype == lens.dtype == torch.int32


def test_reference_one_query_per_request_is_unchanged() -> None:
    table = torch.randint(0, 100, (5, 3), dtype=torch.int32)
    lens_in = _i32(3, 1, 8, 2, 6)
    starts, lens, rows = flatten_queries_reference(_i32(0, 1, 2, 3, 4, 5), lens_in, table, 5)
    assert starts.tolist() == [0, 1, 2, 3, 4, 5]
    assert torch.equal(lens, lens_in) and torch.equal(rows, table)


def test_buffers_reject_too_many_tokens() -> None:
    buffers = FlatQueryBuffers(4, 2, torch.device("cpu"))
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="capacity"):
        flatten_queries(_i32(0, 3, 6), _i32(5, 5), table, 6, buffers)


def _random_batch(
    num_reqs: int, q_len: int, pad_reqs: int, width: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(num_reqs * 100 + q_len * 10 + pad_reqs)
    q_lens = torch.randint(1, q_len + 1, (num_reqs,), generator=gen)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    starts = torch.cat([starts, starts[-1:].repeat(pad_reqs)])
    seq_lens = q_lens + torch.randint(0, 500, (num_reqs,), generator=gen)
    seq_lens = torch.cat([seq_lens, torch.zeros(pad_reqs, dtype=torch.long)])
    table = torch.randint(1, 10_000, (num_reqs + pad_reqs, width), generator=gen)
    num_tokens = int(starts[-1]) + 2 * pad_reqs
    to = dict(dtype=torch.int32, device=device)
    return starts.to(**to), seq_lens.to(**to), table.to(**to), num_tokens


CASES = [(1, 3, 0, 32), (1, 3, 2, 32), (8, 3, 1, 40), (32, 3, 0, 300), (40, 5, 3, 600)]


def _check_kernel_against_reference(device: str) -> None:
    for num_reqs, q_len, pad_reqs, width in CASES:
        starts, seq_lens, table, num_tokens = _random_batch(
            num_reqs, q_len, pad_reqs, width, device
        )
        buffers = FlatQueryBuffers(256, width, torch.device(device))
        buffers.seq_lens.fill_(-7)  # stale values from an earlier step
        got = flatten_queries(starts, seq_lens, table, num_tokens, buffers)
        want = flatten_queries_reference(starts, seq_lens, table, num_tokens)
        case = (num_reqs, q_len, pad_reqs, width)
        assert torch.equal(got[0], want[0]), case
        assert torch.equal(got[1], want[1]), case
        real = want[1] > 0  # padding rows' tables are never read
        assert torch.equal(got[2][real], want[2][real]), case


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_cuda() -> None:
    _check_kernel_against_reference("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_replays_in_cuda_graph() -> None:
    starts, seq_lens, table, num_tokens = _random_batch(8, 3, 0, 64, "cuda")
    buffers = FlatQueryBuffers(64, 64, torch.device("cuda"))
    flatten_queries(starts, seq_lens, table, num_tokens, buffers)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flatten_queries(starts, seq_lens, table, num_tokens, buffers)
    seq_lens.add_(5)
    graph.replay()
    want = flatten_queries_reference(starts, seq_lens, table, num_tokens)
    assert torch.equal(buffers.seq_lens[:num_tokens], want[1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_flat_queries", "_check_kernel_against_reference")
