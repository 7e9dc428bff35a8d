"""How fast this machine runs right now: a fixed piece of host work, timed, and the GPU's clock.

A host-bound engine (a small model, or many requests a step) runs at its CPU's speed of the
moment: clocks that have not come back after the start-up's load on every core, or other work
on the same cores, slow every pass alike; a GPU that idled through the start-ups may run its
first kernels at a lower clock. ``real_work.py`` times the probe before each cell and reads the
SM clock right after its passes, so a first pass slower than the steady ones can be told apart
from a machine that was slower when it ran (round 0 slower on these too).

On the cloud machines we measure on, a core runs the probe at one of two speeds, about 2x
apart, and stays at one for seconds (another tenant's work on the same physical core, as far as
can be told from inside): a host-bound cell then runs at the speed of the core its main thread
landed on. ``fastest_core`` picks the core that is fast at the moment, for every engine alike.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Iterable
from typing import Any

_NVML_CLOCK_SM = 1  # nvmlClockType_t


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


def fastest_core(cores: Iterable[int], repeats: int = 5) -> tuple[int, dict[int, float]]:
    """Probe each of ``cores`` from the calling thread and leave that thread on the fastest
    alone; returns that core and each core's probe (ms). (Linux: ``sched_setaffinity`` with
    pid 0 moves the calling thread only, not the process's other threads.)"""
    probes: dict[int, float] = {}
    for core in sorted(cores):
        os.sched_setaffinity(0, {core})
        probes[core] = probe_ms(repeats)
    best = min(probes, key=probes.__getitem__)
    os.sched_setaffinity(0, {best})
    return best, probes


class CorePicks:
    """One thread's moves to the core of ``cores`` that is fast at the moment, over a run of
    passes: each pick's core and its probe (ms), every core's probes at the first pick, and
    the seconds the picks took (the probing's, not the passes')."""

    def __init__(self, cores: Iterable[int]) -> None:
        self.cores = sorted(cores)
        self.picks: list[tuple[int, float]] = []
        self.first_probes: dict[int, float] = {}
        self.seconds = 0.0

    def pick(self) -> tuple[int, float]:
        started = time.perf_counter()
        core, probes = fastest_core(self.cores)
        self.first_probes = self.first_probes or probes
        self.picks.append((core, probes[core]))
        self.seconds += time.perf_counter() - started
        return core, probes[core]


@functools.cache
def _nvml_device() -> tuple[Any, ctypes.c_void_p] | None:
    """The NVIDIA driver's management library and its handle of GPU 0, or None without one."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle = ctypes.c_void_p()
    if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)):
        return None
    return nvml, handle


def gpu_sm_clock_mhz() -> int | None:
    """GPU 0's SM clock now, in MHz (NVML, a microsecond-scale call); None without a driver."""
    device = _nvml_device()
    if device is None:
        return None
    nvml, handle = device
    mhz = ctypes.c_uint()
    if nvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(mhz)):
        return None
    return int(mhz.value)
