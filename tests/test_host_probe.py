"""The benchmarks' probe of the machine's speed (benchmarks/host_probe.py)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import host_probe  # noqa: E402


def test_the_probe_is_its_fastest_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs of 3, 1 and 2 ms (a start and an end reading each): one preempted run is not the
    # host's speed.
    clock = iter([0.0, 0.003, 1.0, 1.001, 2.0, 2.002])
    monkeypatch.setattr(host_probe.time, "perf_counter", lambda: next(clock))
    assert host_probe.probe_ms(repeats=3) == pytest.approx(1.0)


def test_the_real_probe_takes_a_millisecond_or_so() -> None:
    assert 0.01 < host_probe.probe_ms() < 100


def test_the_thread_moves_to_the_fastest_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # Cores 2, 5 and 7 probe at 0.8, 0.4 and 0.9 ms: the thread is left on core 5 alone.
    speed = {2: 0.8, 5: 0.4, 7: 0.9}
    moves: list[set[int]] = []

    def setaffinity(pid: int, cores: set[int]) -> None:
        assert pid == 0  # the calling thread, not the process's other threads
        moves.append(set(cores))

    monkeypatch.setattr(host_probe.os, "sched_setaffinity", setaffinity)
    monkeypatch.setattr(host_probe, "probe_ms", lambda repeats=5: speed[next(iter(moves[-1]))])
    core, probes = host_probe.fastest_core([7, 2, 5])
    assert core == 5 and probes == speed
    assert moves == [{2}, {5}, {7}, {5}]


def test_core_picks_keep_each_pick_and_their_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Core 3 is fast at the first pick, core 1 at the second.
    rounds = iter([{1: 0.9, 3: 0.4}, {1: 0.45, 3: 0.8}])
    monkeypatch.setattr(host_probe, "fastest_core", lambda cores: _best(next(rounds)))
    picks = host_probe.CorePicks([3, 1])
    assert picks.cores == [1, 3] and picks.pick() == (3, 0.4) and picks.pick() == (1, 0.45)
    assert picks.picks == [(3, 0.4), (1, 0.45)]
    assert picks.first_probes == {1: 0.9, 3: 0.4}
    assert picks.seconds > 0


def _best(probes: dict[int, float]) -> tuple[int, dict[int, float]]:
    return min(probes, key=probes.__getitem__), probes


def test_the_real_pick_leaves_the_thread_on_one_of_the_cores() -> None:
    import os

    cores = os.sched_getaffinity(0)
    try:
        core, probes = host_probe.fastest_core(cores, repeats=2)
        assert set(probes) == cores and os.sched_getaffinity(0) == {core}
        assert probes[core] == min(probes.values())
    finally:
        os.sched_setaffinity(0, cores)


def _fake_nvml(mhz: int, clock_status: int = 0) -> Any:
    def clock_info(handle: Any, kind: int, out: Any) -> int:
        assert kind == 1  # the SM clock
        out._obj.value = mhz
        return clock_status

    return SimpleNamespace(
        nvmlInit_v2=lambda: 0,
        nvmlDeviceGetHandleByIndex_v2=lambda index, handle: 0,
        nvmlDeviceGetClockInfo=clock_info,
    )


@pytest.fixture(autouse=True)
def _fresh_device() -> Any:
    host_probe._nvml_device.cache_clear()
    yield
    host_probe._nvml_device.cache_clear()


def test_the_sm_clock_from_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _fake_nvml(1980))
    assert host_probe.gpu_sm_clock_mhz() == 1980


def test_no_clock_without_a_driver_or_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert host_probe.gpu_sm_clock_mhz() is None
    host_probe._nvml_device.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _fake_nvml(1980, clock_status=999))
    assert host_probe.gpu_sm_clock_mhz() is None
