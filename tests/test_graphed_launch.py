"""``gemma4_spec.ops.graphed_launch``: launches replayed from CUDA graphs by key, and the launch
site that uses it (draft-input staging) giving the reference's values on replays after its
inputs changed."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.graphed_launch import GraphedLaunches, captures_in_process

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_off_when_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from gemma4_spec.ops.graphed_launch import GRAPHED_LAUNCHES_ENV

    monkeypatch.setenv(GRAPHED_LAUNCHES_ENV, "0")
    assert GraphedLaunches("test").disabled == f"{GRAPHED_LAUNCHES_ENV}=0"
    monkeypatch.setenv(GRAPHED_LAUNCHES_ENV, "1")
    assert GraphedLaunches("test").disabled is None


def test_without_cuda_every_call_launches() -> None:
    calls = []
    launches = GraphedLaunches("test")
    for _ in range(3):
        launches.run(("k",), lambda: calls.append(1), torch.device("cpu"))
    assert len(calls) == 3 and launches.captured == 0 and launches.replays == 0


def _adder(x: torch.Tensor, out: torch.Tensor):  # type: ignore[no-untyped-def]
    return lambda: torch.add(x, 1, out=out)


@cuda
def test_replays_a_captured_launch_with_the_inputs_of_the_moment() -> None:
    x, out = torch.zeros(8, device="cuda"), torch.zeros(8, device="cuda")
    launches = GraphedLaunches("test")
    before = captures_in_process()
    launches.run((x.data_ptr(), out.data_ptr()), _adder(x, out), x.device)  # launched and captured
    assert launches.captured == 1 and launches.replays == 0 and out.eq(1).all()
    assert captures_in_process() == before + 1  # what engine runs count while serving
    x.fill_(5)
    launches.run((x.data_ptr(), out.data_ptr()), _adder(x, out), x.device)
    assert launches.replays == 1 and out.eq(6).all()
    y = torch.full((8,), 10.0, device="cuda")  # another tensor: another key, another graph
    launches.run((y.data_ptr(), out.data_ptr()), _adder(y, out), y.device)
    assert launches.captured == 2 and out.eq(11).all()


@cuda
def test_stops_capturing_at_its_limit_and_inside_another_capture() -> None:
    out = torch.zeros(8, device="cuda")
    launches = GraphedLaunches("test", max_graphs=2)
    for value in range(4):
        x = torch.full((8,), float(value), device="cuda")
        launches.run((x.data_ptr(), out.data_ptr()), _adder(x, out), x.device)
        assert out.eq(value + 1).all()
    assert launches.captured == 2

    fresh = GraphedLaunches("test")
    x = torch.zeros(8, device="cuda")
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        fresh.run((x.data_ptr(), out.data_ptr()), _adder(x, out), x.device)
    assert fresh.captured == 0  # the launch became part of the outer graph
    inside = GraphedLaunches("test")  # a key captured before, met again inside a capture
    inside.run((x.data_ptr(), out.data_ptr()), _adder(x, out), x.device)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        inside.run((x.data_ptr(), out.data_ptr()), _adder(x, out), x.device)
    assert inside.replays == 0
    x.fill_(41)
    outer.replay()
    assert out.eq(42).all()


@cuda
def test_a_failed_capture_turns_graphs_off_and_keeps_the_results() -> None:
    out = torch.zeros(8, device="cuda")
    launches = GraphedLaunches("test")
    x = torch.zeros(8, device="cuda")

    def syncs() -> None:  # a host synchronisation cannot be captured
        torch.add(x, 1, out=out)
        out.cpu()

    launches.run((x.data_ptr(), out.data_ptr()), syncs, x.device)
    assert launches.disabled is not None and launches.captured == 0 and out.eq(1).all()
    x.fill_(2)
    launches.run((x.data_ptr(), out.data_ptr()), syncs, x.device)  # launched as it is
    assert out.eq(3).all()


@cuda
def test_staging_replays_match_the_reference() -> None:
    from test_draft_inputs import _random_step

    from gemma4_spec.ops.draft_inputs import stage_draft_inputs, stage_draft_inputs_reference

    src, out = _random_step(5, 8, 3, (40, 40), True, "cuda")
    launches = GraphedLaunches("staging")
    for step in range(3):
        src.hidden.mul_(2)
        src.seq_lens.add_(step)
        stage_draft_inputs(src, out, 5, 8, launches)
        want = stage_draft_inputs_reference(src, 5, 8)
        assert torch.equal(out.hidden[:8], want.hidden), step
        assert torch.equal(out.seq_lens[:8], want.seq_lens), step
        assert torch.equal(out.tables[1][:8], want.tables[1]), step
    assert launches.captured == 1 and launches.replays == 2
