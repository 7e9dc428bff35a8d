"""Shared pytest hooks: figures that tests measure (e.g. acceptance rates) shown at the end of
the run, so they appear in the CI log even with ``pytest -q``; a runner of code under Triton's
interpreter; an environment switch set or unset for one test; the ``cuda_triton`` mark's skip."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

_FIGURES: list[tuple[str, str]] = []


@functools.cache
def _cuda_and_triton() -> bool:
    import torch

    from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON

    return HAS_TRITON and torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A kernel's GPU tests (``@pytest.mark.cuda_triton``) skip, before their fixtures, where
    there is no CUDA GPU or no triton; their CPU side runs under Triton's interpreter."""
    if item.get_closest_marker("cuda_triton") is not None and not _cuda_and_triton():
        pytest.skip("needs a CUDA GPU and triton (the CPU side runs under the interpreter)")


@pytest.fixture
def report_figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``report_figure(line)``: print ``line`` under the test's name in the terminal summary."""

    def record(line: str) -> None:
        _FIGURES.append((request.node.nodeid, line))

    return record


@pytest.fixture
def set_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str | None], None]:
    """``set_env(name, value)``: the variable set to ``value`` for this test, or unset (its
    default) where ``value`` is None."""

    def set_or_unset(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)

    return set_or_unset


@pytest.fixture
def check_under_interpreter() -> Callable[[str, str], None]:
    """``check(module, function)``: calls ``function('cpu')`` of the test module ``module`` in a
    fresh Python with ``TRITON_INTERPRET=1`` (it must be set before triton is imported), where
    Triton kernels run on CPU tensors; fails with that Python's output if it does."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")])

    def check(module: str, function: str) -> None:
        code = f"import {module} as t; t.{function}('cpu')"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stdout + out.stderr

    return check


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.write_sep("=", "measured figures")
    current = None
    for nodeid, line in _FIGURES:
        if nodeid != current:
            terminalreporter.write_line(nodeid)
            current = nodeid
        terminalreporter.write_line(f"  {line}")
