"""How fast this process runs Python right now: a fixed piece of host work, timed.

A host-bound engine (a small model, or many requests a step) runs at its CPU's speed of the
moment: clocks that have not come back after the start-up's load on every core, or other work
on the same cores, slow every pass alike. ``real_work.py`` times this probe before each cell,
so a first pass slower than the steady ones can be told apart from a host that was slower when
it ran (the same probe slower in round 0 than in the later rounds).
"""

from __future__ import annotations

import time


def _work(items: int = 4000) -> int:
    """Dictionary and list work of the kind a scheduler step does (about a millisecond)."""
    counts: dict[int, int] = {}
    for i in range(items):
        key = (i * 7919) & 1023
        counts[key] = counts.get(key, 0) + i
    return sum(sorted(counts.values())[:16])


def probe_ms(repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs of the fixed work, in milliseconds: the fastest, so one
    preemption does not count, while a slower CPU slows every run."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _work()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
