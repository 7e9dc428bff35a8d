"""Engines in their own processes, started together, then timed in turns (``e2e_decode.py``,
``real_work.py``): a drift of the machine during the run then spreads over every engine alike.

The protocol, through files in a control folder: engine ``i`` touches ``i.ready`` once started,
waits for ``i.go<r>`` before its round ``r`` and touches ``i.done<r>`` after it, and writes its
results to ``i.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# vLLM's switch for where an engine's core runs: "0" in the front end's process, "1" in its own.
CORE_IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def engine_env(
    overrides: dict[str, str], cache_root: Path, core_in_process: bool = True
) -> dict[str, str]:
    """The environment of one engine: ours plus ``overrides``; ``VLLM_PLUGINS`` only where the
    engine sets it (every installed plugin loads otherwise); its own compile caches, vLLM's and
    Triton's (no races, and each engine's first pass pays for its own kernel compilations, not
    for those of an engine that ran before it). With ``core_in_process`` the engine core runs
    in the worker process, beside the ``LLM`` front end (a multiprocess start of ours hung once
    on the H200 before loading weights); without it, in a process of its own, vLLM's default,
    where the front end's output processing overlaps the engine's steps."""
    env = dict(os.environ, **overrides)
    if "VLLM_PLUGINS" not in overrides:
        env.pop("VLLM_PLUGINS", None)
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    env["TRITON_CACHE_DIR"] = str(cache_root / "triton")
    env[CORE_IN_PROCESS_ENV] = "0" if core_in_process else "1"
    return env


class EngineTurns:
    """The parent's side: start engines, wait until all are ready, give them their turns."""

    def __init__(self, control: Path) -> None:
        self.control = control
        control.mkdir(parents=True, exist_ok=True)
        for stale in control.iterdir():
            stale.unlink()
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        # Engines that exited before they were ready (``wait_ready(..., drop_failed=True)``):
        # name -> the exception lines of their output. They take no turns and have no results.
        self.not_started: dict[str, list[str]] = {}
        self._dropped: set[int] = set()
        # One entry a turn of an engine: its name, the turn's wall seconds, the CPU seconds
        # the other engines' process trees used meanwhile (they should be idle), and those
        # the rest of the machine used (neither the engine timed nor the others: the kernel's
        # threads, other programs; they take cores from a host-bound engine too).
        self.turn_log: list[dict[str, Any]] = []

    def start(self, name: str, script: str, args: list[str], env: dict[str, str]) -> None:
        """Start the next engine, ``i``: ``script --worker --control C --index i --out C/i.json``
        then ``args``; its output goes to ``engine-<i>.log`` in the control folder ``C``."""
        i = len(self._procs)
        command = [sys.executable, script, "--worker", "--control", str(self.control),
                   "--index", str(i), "--out", str(self.control / f"{i}.json"), *args]  # fmt: skip
        log = open(self.control / f"engine-{i}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._procs.append((name, proc))

    def _fail(self, i: int, what: str) -> None:
        for _, proc in self._procs:
            proc.kill()
        tail = (self.control / f"engine-{i}.log").read_text()[-6000:]
        raise SystemExit(f"engine '{self._procs[i][0]}' {what}:\n{tail}")

    def wait_ready(self, timeout: float, drop_failed: bool = False) -> None:
        """Until every engine is ready. One that exits first stops the run, or with
        ``drop_failed`` is left out of it (``not_started``); running past ``timeout`` stops it."""
        from gemma4_spec.testing.engine_run import error_lines

        deadline = time.monotonic() + timeout
        for i, (name, proc) in enumerate(self._procs):
            while not (self.control / f"{i}.ready").exists():
                if proc.poll() is not None and drop_failed:
                    log = (self.control / f"engine-{i}.log").read_text()
                    self.not_started[name] = error_lines(log) or log.splitlines()[-1:]
                    self._dropped.add(i)
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    self._fail(i, "did not start")
                time.sleep(0.5)
        if len(self._dropped) == len(self._procs):
            raise SystemExit(f"no engine started: {self.not_started}")

    def _running(self) -> list[tuple[int, str, subprocess.Popen[bytes]]]:
        return [(i, n, p) for i, (n, p) in enumerate(self._procs) if i not in self._dropped]

    def take_turns(self, rounds: int, reverse_every: int = 0, settle_s: float = 0.0) -> None:
        """``rounds`` turns, each engine in start order; with ``reverse_every`` = n, turns
        n to 2n - 1, 3n to 4n - 1, ... go in reverse order, so that over an even number of
        such blocks each engine is timed as often right after each other engine as before it
        (a drift of the host inside a turn, or an engine that warms or cools the host for the
        next, then weighs on every engine alike). ``settle_s``: seconds to wait before the
        first turn, for a host to come back from the engines' start-ups on all its cores."""
        time.sleep(settle_s)
        for rnd in range(rounds):
            running = self._running()
            if reverse_every and (rnd // reverse_every) % 2:
                running.reverse()
            for i, name, proc in running:
                others = [other.pid for j, _, other in running if j != i]
                before = sum(tree_cpu_seconds(pid) for pid in others)
                own, machine = tree_cpu_seconds(proc.pid), machine_cpu_seconds()
                started = time.perf_counter()
                (self.control / f"{i}.go{rnd}").touch()
                while not (self.control / f"{i}.done{rnd}").exists():
                    if proc.poll() is not None:
                        self._fail(i, "failed")
                    time.sleep(0.02)
                wall = time.perf_counter() - started
                idle = sum(tree_cpu_seconds(pid) for pid in others) - before
                own = tree_cpu_seconds(proc.pid) - own
                rest = max(machine_cpu_seconds() - machine - own - idle, 0.0)
                self.turn_log.append(
                    {"engine": name, "wall_s": wall, "others_cpu_s": idle, "rest_cpu_s": rest}
                )

    def results(self) -> dict[str, Any]:
        """Each engine's results, by name, once they have all exited."""
        results: dict[str, Any] = {}
        for i, name, proc in self._running():
            if proc.wait(timeout=300) != 0:
                self._fail(i, "failed")
            results[name] = json.loads((self.control / f"{i}.json").read_text())
        return results


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (Linux ``/proc``)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(child) for child in task.read_text().split())
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """The user and system CPU seconds ``pid``'s process tree has used so far, every thread
    of it (Linux ``/proc``; processes that have ended are not counted)."""
    ticks = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # After the command's closing parenthesis, utime and stime are the 12th and 13th.
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """The CPU seconds every core of the machine has been busy so far (Linux ``/proc/stat``:
    user, nice, system, irq, softirq and steal time; not idle or waiting on I/O)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def worker_ready(control: Path, index: int) -> None:
    (control / f"{index}.ready").touch()


def wait_turn(control: Path, index: int, rnd: int) -> None:
    while not (control / f"{index}.go{rnd}").exists():
        time.sleep(0.02)


def turn_done(control: Path, index: int, rnd: int) -> None:
    (control / f"{index}.done{rnd}").touch()
