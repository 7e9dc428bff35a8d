"""Work a timed pass did that start-up could have done: Triton JIT compilations, CUDA graph
captures, TorchDynamo graphs compiled, device allocations of the CUDA caching allocator, and
the garbage collector's pauses, counted in this process.

``real_work.py`` records them for every cell, so a first pass slower than its engine's steady
passes shows what it did that they did not; ``first_pass_profile.py`` prints them beside its
profiles. With the engine core in another process, the core's work is not seen here.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Seconds and collections of Python's garbage collector, by generation, since ``reset``."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.seconds, self.collections = [0.0, 0.0, 0.0], [0, 0, 0]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def __str__(self) -> str:
        return ", ".join(
            f"gen{g} {n} x {s * 1e3:.1f} ms"
            for g, (n, s) in enumerate(zip(self.collections, self.seconds, strict=True))
        )


# The caching allocator's counters a pass is judged by (torch.cuda.memory_stats keys): its
# cudaMalloc calls and cudaFree calls, the bytes those calls reserved, and its retries (a
# failed cudaMalloc after which it frees its cached blocks, synchronizing the device, and
# tries again: the costly kind of allocation).
ALLOCATOR_STATS = {
    "device_allocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "device_alloc_bytes": "reserved_bytes.all.allocated",
    "alloc_retries": "num_alloc_retries",
}


def allocator_counts() -> dict[str, int]:
    """``ALLOCATOR_STATS`` so far (all 0 without CUDA)."""
    import torch

    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {key: int(stats.get(name, 0)) for key, name in ALLOCATOR_STATS.items()}


def dynamo_graphs() -> int:
    """Graphs TorchDynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class LazyWork:
    """Counts of the work above; ``since(before)`` gives what happened between two ``take``s."""

    def __init__(self) -> None:
        from gemma4_spec.testing.engine_run import watch_graph_captures, watch_triton_compiles

        self.compiled: list[str] = []
        try:
            watch_triton_compiles(self.compiled.append)
        except ImportError:  # no Triton (the CPU machines): nothing is JIT-compiled
            pass
        self.captures = 0
        watch_graph_captures(self._captured)
        self.pauses = GcPauses()

    def _captured(self) -> None:
        self.captures += 1

    def take(self) -> dict[str, Any]:
        return {
            "triton": len(self.compiled),
            "graph_captures": self.captures,
            "dynamo_graphs": dynamo_graphs(),
            **allocator_counts(),
            "gc_s": sum(self.pauses.seconds),
            "gc_full": self.pauses.collections[2],
        }

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        """What happened since ``before`` (a ``take``): counts, GC seconds and the Triton
        kernels compiled (by name and specialisation)."""
        now = self.take()
        done: dict[str, Any] = {key: now[key] - before[key] for key in now}
        done["triton_kernels"] = self.compiled[before["triton"] :]
        return done


# The counts a table prints, and their labels.
COUNTED = (
    ("triton", "Triton compiles"),
    ("graph_captures", "graph captures"),
    ("dynamo_graphs", "Dynamo graphs"),
    ("device_allocs", "device allocations"),
    ("alloc_retries", "allocator retries"),
)


def describe(done: dict[str, Any]) -> str:
    """One line: the counts that are not zero (device allocations with the MiB they
    reserved), and the garbage collector's milliseconds."""
    parts = []
    for key, label in COUNTED:
        if done.get(key):
            part = f"{label} {done[key]}"
            if key == "device_allocs" and done.get("device_alloc_bytes"):
                part += f" ({done['device_alloc_bytes'] / 2**20:.0f} MiB)"
            parts.append(part)
    if done.get("gc_s", 0.0) >= 1e-3:
        parts.append(f"GC {done['gc_s'] * 1e3:.0f} ms ({done.get('gc_full', 0)} full)")
    return ", ".join(parts) or "nothing"


def total(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts and GC seconds of several ``since`` results added up."""
    keys = [key for key, _ in COUNTED] + ["device_alloc_bytes", "gc_s", "gc_full"]
    return {key: sum(cell.get(key, 0) for cell in cells) for key in keys}
