"""Start-up upload of Model Runner V2's CUDA graphs (``spec_decode/graph_upload.py``): which
graphs it finds, when it runs, that a failure leaves serving as it was, and on CUDA that an
uploaded graph replays what it captured."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gemma4_spec.spec_decode import graph_upload
from gemma4_spec.spec_decode.graph_upload import (
    GRAPH_UPLOAD_ENV,
    runner_graphs,
    upload_graphs,
    upload_runner_graphs,
)


class _Graph:
    def __init__(self, name: str) -> None:
        self.name = name

    def replay(self) -> None:
        raise AssertionError("an upload must not replay a graph")


def _runner(device: str = "cuda") -> Any:
    """A V2 runner's shape: the target's manager and a speculator with two managers (vLLM's
    draft prefill and decode) and attributes that are not managers."""
    target = SimpleNamespace(graphs={"t8": _Graph("t8"), "t16": _Graph("t16")})
    speculator = SimpleNamespace(
        prefill_cudagraph_manager=SimpleNamespace(graphs={}),
        decode_cudagraph_manager=SimpleNamespace(graphs={"d8": _Graph("d8")}),
        model=torch.nn.Linear(2, 2),  # an nn.Module: getattr(graphs) raises inside
        graphs_seen=3,
        buffers=SimpleNamespace(graphs=[_Graph("not a manager's dict")]),
    )
    return SimpleNamespace(
        device=torch.device(device), cudagraph_manager=target, speculator=speculator
    )


def test_finds_the_target_and_speculator_graphs() -> None:
    assert [g.name for g in runner_graphs(_runner())] == ["t8", "t16", "d8"]


def test_a_runner_without_graphs_or_speculator() -> None:
    assert runner_graphs(SimpleNamespace(cudagraph_manager=None, speculator=None)) == []
    assert runner_graphs(SimpleNamespace()) == []


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The current stream, faked where there is no CUDA: records synchronisations."""
    events: list[str] = []
    stream = SimpleNamespace(cuda_stream=7, synchronize=lambda: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    return events


def _recorder(calls: list[tuple[str, int]], fail_at: str | None = None) -> Callable[..., None]:
    def upload(graph: _Graph, stream: int) -> None:
        if graph.name == fail_at:
            raise RuntimeError("cuGraphUpload returned CUresult 1")
        calls.append((graph.name, stream))

    return upload


def test_uploads_every_graph_on_the_current_stream_then_waits(
    streams: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(GRAPH_UPLOAD_ENV, raising=False)
    calls: list[tuple[str, int]] = []
    assert upload_runner_graphs(_runner(), _recorder(calls)) == 3
    assert calls == [("t8", 7), ("t16", 7), ("d8", 7)]
    assert streams == ["sync"]


@pytest.mark.parametrize(("device", "env"), [("cpu", None), ("cuda", "0")])
def test_off_on_cpu_and_with_the_switch(
    set_env: Callable[[str, str | None], None], device: str, env: str | None
) -> None:
    set_env(GRAPH_UPLOAD_ENV, env)
    calls: list[tuple[str, int]] = []
    assert upload_runner_graphs(_runner(device), _recorder(calls)) == 0
    assert calls == []


def test_a_failed_upload_stops_the_uploads_without_raising(
    streams: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[str, int]] = []
    graphs = runner_graphs(_runner())
    assert upload_graphs(graphs, _recorder(calls, fail_at="t16")) == 1
    assert calls == [("t8", 7)]
    assert streams == ["sync"]
    assert "not uploaded" in caplog.text and "CUresult 1" in caplog.text


def test_the_driver_call_reports_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-zero CUresult becomes an error that ``upload_graphs`` catches."""
    driver = SimpleNamespace(cuGraphUpload=lambda exec_, stream: 400)
    monkeypatch.setattr(graph_upload, "_libcuda", lambda: driver)
    graph = SimpleNamespace(raw_cuda_graph_exec=lambda: 1234)
    with pytest.raises(RuntimeError, match="CUresult 400"):
        graph_upload._driver_upload(graph, 0)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_uploaded_graph_replays_what_it_captured_cuda() -> None:
    x = torch.randn(64, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    out = torch.empty_like(x)
    # One eager run first: cuBLAS creates its handle on the first matmul, which cannot happen
    # inside a capture (in a fresh process this test would otherwise fail before uploading).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(torch.tanh(x @ w))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.tanh(x @ w))
    out.zero_()
    assert upload_graphs([graph]) == 1
    torch.cuda.synchronize()
    assert not out.any()  # an upload runs nothing
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.tanh(x @ w))
