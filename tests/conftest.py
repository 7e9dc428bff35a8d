"""Shared pytest hooks: figures that tests measure (e.g. acceptance rates) shown at the end of
the run, so they appear in the CI log even with ``pytest -q``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_FIGURES: list[tuple[str, str]] = []


@pytest.fixture
def report_figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``report_figure(line)``: print ``line`` under the test's name in the terminal summary."""

    def record(line: str) -> None:
        _FIGURES.append((request.node.nodeid, line))

    return record


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
