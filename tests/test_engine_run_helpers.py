"""``testing.engine_run``'s helpers: what a report of a failed engine run names
(``error_lines``), and the count of CUDA graphs a worker captures while serving."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.testing import engine_run
from gemma4_spec.testing.engine_run import error_lines

# Shaped like the tail of the H200's failed in-tree V1 start on the tiny 26B-A4B shape: the
# exception is buried under the warnings printed after it.
FAILED_RUN = """engine run failed (exit 1):
Traceback (most recent call last):
[rank0]:   File "/tmp/site/vllm/v1/engine/core.py", line 120, in __init__
[rank0]: RuntimeError: a and b must have same reduction dim, but got [4, 64] X [192, 1024].
ERROR 12-01 22:21:20 [core.py:900] EngineCore failed to start.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
[rank0]:  For more details about this graph break, please visit: https://example.invalid/gb4315
[rank0]:[W1201 22:21:21 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group()
"""


def test_names_the_exceptions_not_the_warnings_after_them() -> None:
    assert error_lines(FAILED_RUN) == [
        "RuntimeError: a and b must have same reduction dim, but got [4, 64] X [192, 1024].",
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ]


def test_keeps_the_last_distinct_ones() -> None:
    text = "ValueError: first\nKeyError: 'x'\nValueError: first\ntorch.OutOfMemoryError: big\n"
    assert error_lines(text, limit=2) == ["KeyError: 'x'", "torch.OutOfMemoryError: big"]
    assert error_lines("Warning: nothing failed here\n") == []


def test_prose_that_mentions_an_error_is_no_exception_line() -> None:
    assert error_lines("Error handling went fine\nNo RuntimeError here\n") == []


def test_graph_captures_counted_once_per_capture_from_the_latest_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A capture that does nothing (no CUDA here), and a fresh count, as a worker has them.
    began: list[object] = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda g, *a, **k: began.append(g))
    monkeypatch.setattr(engine_run._GraphCaptures, "total", 0)
    monkeypatch.setattr(engine_run._GraphCaptures, "at_start", None)
    monkeypatch.setattr(engine_run, "watch_triton_compiles", lambda note: None)  # not here
    counts = engine_run._GraphCaptures
    assert counts.since_start() == 0
    engine_run._count_triton_compiles(None)
    torch.cuda.CUDAGraph.capture_begin("graph 1")
    torch.cuda.CUDAGraph.capture_begin("graph 2", pool=(0, 1))
    assert counts.since_start() == 2 and began == ["graph 1", "graph 2"]
    # A second engine in the same process counts from its own start, each capture once.
    engine_run._count_triton_compiles(None)
    torch.cuda.CUDAGraph.capture_begin("graph 3")
    assert counts.since_start() == 1 and began[-1] == "graph 3"
