"""``gemma4_spec.ops.draft_inputs``: the reference against a hand-worked step, the staging (torch
fallback, and the Triton kernel on CUDA or under Triton's interpreter) against the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.draft_inputs import (
    DraftStepBuffers,
    DraftStepSources,
    RunnerV2Step,
    stage_draft_inputs,
    stage_draft_inputs_reference,
    stage_runner_v2_inputs,
    stage_runner_v2_inputs_reference,
)


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_reference_hand_worked_step() -> None:
    # Two requests verified 3 tokens each (rows 0-2 and 3-5); request 0 accepted 1 token (its
    # last accepted row is 1, 1 rejected), request 1 accepted both (row 5). Drafted as 4 rows.
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)
    src = DraftStepSources(
        next_token_ids=_i32(70, 71),
        positions=torch.tensor([10, 11, 12, 20, 21, 22]),
        hidden=hidden,
        rows=_i32(1, 5),
        seq_lens=_i32(13, 23),
        rejected=_i32(1, 0),
        tables=(torch.tensor([[4, 5], [6, 7]], dtype=torch.int32),),
    )
    got = stage_draft_inputs_reference(src, batch_size=2, size=4)
    assert got.input_ids.tolist() == [70, 71, 0, 0]
    assert got.positions.tolist() == [11, 22, 0, 0]
    assert got.hidden.tolist() == [[2.0, 3.0], [10.0, 11.0], [0.0, 0.0], [0.0, 0.0]]
    assert got.seq_lens.tolist() == [12, 23, 1, 1]
    assert got.tables[0].tolist() == [[4, 5], [6, 7], [0, 0], [0, 0]]
    assert got.input_ids.dtype == got.seq_lens.dtype == torch.int32


def _random_step(
    batch_size: int, size: int, q_len: int, widths: tuple[int, ...], rejected: bool, device: str
) -> tuple[DraftStepSources, DraftStepBuffers]:
    gen = torch.Generator().manual_seed(batch_size * 1000 + size * 10 + len(widths))
    n, h, cap = batch_size * q_len, 1536, 64

    def ints(low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, dtype=torch.int32)

    src = DraftStepSources(
        next_token_ids=ints(0, 262144, batch_size),
        positions=ints(0, 4096, n).long(),
        hidden=torch.randn(n, h, generator=gen).to(torch.bfloat16),
        rows=torch.arange(batch_size, dtype=torch.int32) * q_len + ints(0, q_len, batch_size),
        seq_lens=ints(q_len, 5000, batch_size),
        rejected=ints(0, q_len, batch_size) if rejected else None,
        tables=tuple(ints(1, 10_000, batch_size + 3, w) for w in widths),
    )
    out = DraftStepBuffers(  # stale contents from an earlier step
        input_ids=torch.full((cap,), -3, dtype=torch.int32),
        positions=torch.full((cap,), -3, dtype=torch.long),
        hidden=torch.full((cap, h), float("nan"), dtype=torch.bfloat16),
        seq_lens=torch.full((cap,), -3, dtype=torch.int32),
        # Buffer tables wider and narrower than the runner's: rows copied to the narrower.
        tables=tuple(
            torch.full((cap, w + (8 if i % 2 == 0 else -1)), -3, dtype=torch.int32)
            for i, w in enumerate(widths)
        ),
    )
    move = {
        f: getattr(src, f) for f in ("next_token_ids", "positions", "hidden", "rows", "seq_lens")
    }
    return (
        DraftStepSources(
            **{k: v.to(device) for k, v in move.items()},
            rejected=None if src.rejected is None else src.rejected.to(device),
            tables=tuple(t.to(device) for t in src.tables),
        ),
        DraftStepBuffers(
            input_ids=out.input_ids.to(device), positions=out.positions.to(device),
            hidden=out.hidden.to(device), seq_lens=out.seq_lens.to(device),
            tables=tuple(t.to(device) for t in out.tables),
        ),
    )  # fmt: skip


# (batch, rows, query tokens per request, block-table widths, rejected given)
CASES = [
    (1, 1, 3, (32, 32), True),
    (1, 4, 3, (32,), False),
    (5, 8, 5, (40, 2100), True),
    (32, 32, 3, (300, 17, 64), True),  # three groups: a second launch for the third table
    (3, 16, 1, (), False),
]


def _check_against_reference(device: str, kernel: bool = True) -> None:
    # kernel=False: the torch fallback, which CPU runs without Triton's interpreter.
    assert triton_usable(torch.device(device)) is kernel, "not the path this check is for"
    for batch_size, size, q_len, widths, rejected in CASES:
        src, out = _random_step(batch_size, size, q_len, widths, rejected, device)
        stage_draft_inputs(src, out, batch_size, size)
        want = stage_draft_inputs_reference(src, batch_size, size)
        case = (batch_size, size, q_len, widths, rejected)
        for name in ("input_ids", "positions", "hidden", "seq_lens"):
            assert torch.equal(getattr(out, name)[:size], getattr(want, name)), (case, name)
            assert torch.all(getattr(out, name)[size : size + 1] != 0), (case, name, "past size")
        for got_t, want_t in zip(out.tables, want.tables, strict=True):
            width = min(got_t.shape[1], want_t.shape[1])
            assert torch.equal(got_t[:size, :width], want_t[:, :width]), case
            assert (got_t[:size, width:] == -3).all(), (case, "past the narrower width")
            assert (got_t[size:] == -3).all(), (case, "past size")


def test_staging_matches_reference_torch_fallback() -> None:
    _check_against_reference("cpu", kernel=False)


def test_staging_rejects_mismatched_buffers() -> None:
    src, out = _random_step(2, 4, 3, (8,), True, "cpu")
    with pytest.raises(ValueError, match="exceed"):
        stage_draft_inputs(src, out, 2, 65)
    with pytest.raises(ValueError, match="batch_size <= size"):
        stage_draft_inputs(src, out, 5, 4)
    narrow = DraftStepBuffers(
        out.input_ids, out.positions, out.hidden[:, :8], out.seq_lens, out.tables
    )
    with pytest.raises(ValueError, match="hidden width"):
        stage_draft_inputs(src, narrow, 2, 4)
    with pytest.raises(ValueError, match="block tables"):
        stage_draft_inputs(
            src, DraftStepBuffers(out.input_ids, out.positions, out.hidden, out.seq_lens, ()), 2, 4
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_matches_reference_cuda() -> None:
    _check_against_reference("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_replays_in_cuda_graph() -> None:
    src, out = _random_step(5, 8, 3, (40, 40), True, "cuda")
    stage_draft_inputs(src, out, 5, 8)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage_draft_inputs(src, out, 5, 8)
    src.hidden.mul_(2)
    src.seq_lens.add_(7)
    graph.replay()
    want = stage_draft_inputs_reference(src, 5, 8)
    assert torch.equal(out.hidden[:8], want.hidden)
    assert torch.equal(out.seq_lens[:8], want.seq_lens)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_staging_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_draft_inputs", "_check_against_reference")


# Model Runner V2's staging: the rows and tokens derived on the GPU, the draft batch's
# query_start_loc written, padding rows given no keys.


def test_runner_v2_reference_hand_worked_step() -> None:
    # Three requests in batch rows 0-2 (request states 2, 0, 1): two verified 3 tokens (rows
    # 0-2 and 3-5), the third is a prompt chunk of 2 tokens (rows 6-7) that samples nothing.
    # Request 0 rejected 2 drafts (last accepted row 0), request 1 none (row 5).
    hidden = torch.arange(16, dtype=torch.float32).view(8, 2)
    step = RunnerV2Step(
        query_start_loc=_i32(0, 3, 6, 8),
        seq_lens=_i32(13, 23, 40),
        positions=torch.tensor([10, 11, 12, 20, 21, 22, 38, 39]),
        hidden=hidden,
        idx_mapping=_i32(2, 0, 1),
        num_sampled=_i32(1, 3, 0),
        rejected=_i32(2, 0, 0),
        last_sampled=torch.tensor([[500], [501], [502]]),  # vLLM's [states, 1]
        next_prefill_tokens=_i32(600, 601, 602),
    )
    got, starts = stage_runner_v2_inputs_reference(step, batch_size=3, size=4)
    assert got.input_ids.tolist() == [502, 500, 601, 0]
    assert got.positions.tolist() == [10, 22, 39, 0]
    assert got.hidden.tolist() == [[0.0, 1.0], [10.0, 11.0], [14.0, 15.0], [0.0, 0.0]]
    assert got.seq_lens.tolist() == [11, 23, 40, 0]
    assert starts.tolist() == [0, 1, 2, 3, 3]
    assert got.tables == ()


def _random_v2_step(
    batch_size: int, size: int, q_len: int, device: str
) -> tuple[RunnerV2Step, DraftStepBuffers, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch_size * 100 + size)
    n, h, cap, states = batch_size * q_len, 1536, 72, 80  # cap > every size: rows past it

    def ints(low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, dtype=torch.int32)

    num_sampled = ints(0, q_len + 1, batch_size)
    step = RunnerV2Step(
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32) * q_len,
        seq_lens=ints(q_len, 5000, batch_size),
        positions=ints(0, 4096, n).long(),
        hidden=torch.randn(n, h, generator=gen).to(torch.bfloat16),
        idx_mapping=torch.randperm(states, generator=gen)[:batch_size].to(torch.int32),
        num_sampled=num_sampled,
        rejected=torch.where(num_sampled > 0, ints(0, q_len, batch_size), 0),
        last_sampled=torch.randint(0, 262144, (states, 1), generator=gen),  # vLLM's shape
        next_prefill_tokens=ints(0, 262144, states),
    )
    out = DraftStepBuffers(  # stale contents from an earlier step
        input_ids=torch.full((cap,), -3, dtype=torch.int32),
        positions=torch.full((cap,), -3, dtype=torch.long),
        hidden=torch.full((cap, h), float("nan"), dtype=torch.bfloat16),
        seq_lens=torch.full((cap,), -3, dtype=torch.int32),
        tables=(),
    )
    starts = torch.full((cap + 2,), -3, dtype=torch.int32)
    moved = RunnerV2Step(**{f: getattr(step, f).to(device) for f in step.__dataclass_fields__})
    out = DraftStepBuffers(
        input_ids=out.input_ids.to(device), positions=out.positions.to(device),
        hidden=out.hidden.to(device), seq_lens=out.seq_lens.to(device), tables=(),
    )  # fmt: skip
    return moved, out, starts.to(device)


# (batch, rows, query tokens per request)
V2_CASES = [(1, 1, 4), (1, 4, 4), (5, 8, 3), (16, 16, 4), (3, 24, 1), (64, 64, 2)]


def _check_runner_v2_against_reference(device: str, kernel: bool = True) -> None:
    # kernel=False: the torch fallback, which CPU runs without Triton's interpreter.
    assert triton_usable(torch.device(device)) is kernel, "not the path this check is for"
    for batch_size, size, q_len in V2_CASES:
        step, out, starts = _random_v2_step(batch_size, size, q_len, device)
        stage_runner_v2_inputs(step, out, starts, batch_size, size)
        want, want_starts = stage_runner_v2_inputs_reference(step, batch_size, size)
        case = (batch_size, size, q_len)
        for name in ("input_ids", "positions", "hidden", "seq_lens"):
            assert torch.equal(getattr(out, name)[:size], getattr(want, name)), (case, name)
            assert torch.all(getattr(out, name)[size : size + 1] != 0), (case, name, "past size")
        assert torch.equal(starts[: size + 1], want_starts), case
        assert starts[size + 1].item() == -3, case


def test_runner_v2_staging_matches_reference_torch_fallback() -> None:
    _check_runner_v2_against_reference("cpu", kernel=False)


def test_runner_v2_staging_rejects_bad_buffers() -> None:
    step, out, starts = _random_v2_step(2, 4, 3, "cpu")
    with pytest.raises(ValueError, match="query_start_loc holds"):
        stage_runner_v2_inputs(step, out, starts[:4], 2, 4)
    wide = dataclasses.replace(step, last_sampled=step.last_sampled.expand(-1, 2))
    with pytest.raises(ValueError, match="one token per request state"):
        stage_runner_v2_inputs(wide, out, starts, 2, 4)
    with_tables = DraftStepBuffers(
        out.input_ids, out.positions, out.hidden, out.seq_lens, (torch.zeros(64, 8),)
    )
    with pytest.raises(ValueError, match="keeps its block tables"):
        stage_runner_v2_inputs(step, with_tables, starts, 2, 4)
    with pytest.raises(ValueError, match="exceed"):
        stage_runner_v2_inputs(step, out, torch.zeros(80, dtype=torch.int32), 2, 73)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_v2_staging_matches_reference_cuda() -> None:
    _check_runner_v2_against_reference("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_runner_v2_staging_kernel_matches_reference_under_interpreter(
    check_under_interpreter,
) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_draft_inputs", "_check_runner_v2_against_reference")
