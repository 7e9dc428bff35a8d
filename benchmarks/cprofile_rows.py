"""cProfile statistics by function, and what one run did more than another: the host's view
that ``first_pass_profile.py`` (a first pass against the second) and ``profile_decode.py`` (a
long run against a short one, per output token) both rank."""

from __future__ import annotations

import cProfile
import pstats

Function = tuple[str, int, str]  # (file, line, name), as pstats keys them
Row = tuple[float, float, float]  # calls, own seconds, cumulative seconds
NONE: Row = (0.0, 0.0, 0.0)


def by_function(profile: cProfile.Profile) -> dict[Function, Row]:
    """Each function's calls, own time and cumulative time in ``profile``."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {func: (float(nc), tt, ct) for func, (_, nc, tt, ct, _) in stats.items()}


def difference(
    more: dict[Function, Row], less: dict[Function, Row], over: float = 1.0
) -> dict[Function, Row]:
    """Each function of ``more``: its row minus its row in ``less`` (none there: nothing), over
    ``over``."""
    rows: dict[Function, Row] = {}
    for func, (calls, own, cumulative) in more.items():
        calls_then, own_then, cumulative_then = less.get(func, NONE)
        rows[func] = ((calls - calls_then) / over, (own - own_then) / over,
                      (cumulative - cumulative_then) / over)  # fmt: skip
    return rows


def ranked(rows: dict[Function, Row], column: int, top: int) -> list[tuple[Function, Row]]:
    """The ``top`` functions by ``column`` of their rows (1: own time, 2: cumulative), largest
    first."""
    return sorted(rows.items(), key=lambda item: -item[1][column])[:top]


def label(func: Function) -> str:
    """``dir/dir/file.py:line(name)``: the last three parts of the path tell vLLM's, torch's and
    ours apart, and one ``__init__.py`` from another."""
    path, line, name = func
    return f"{'/'.join(path.rsplit('/', 3)[-3:])}:{line}({name})"
