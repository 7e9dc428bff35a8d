"""Small per-step kernel launches replayed from CUDA graphs, to spare the host Triton's dispatch.

Launching a Triton kernel from Python costs the host ~40 us on the H200 machine (argument
binding, specialization, cache lookup), against ~4 us to replay the same launch from a CUDA
graph (``benchmarks/launch_overhead.py``). The plugin launches a tiny kernel every speculative
step, outside any graph: the draft-input staging. At small batches the step is bound by the
host, so that launch is on its critical path.

``GraphedLaunches.run(key, launch)`` runs ``launch`` (a callable that launches kernels over
tensors it closes over) and, the first time a ``key`` is seen, also captures it in a CUDA graph;
later calls with the same key replay that graph instead. The key must name everything the
launch bakes in: the address of every tensor it reads or writes and every scalar kernel
argument (strides and sizes included), the grid and compile-time choices. Keys are built by the
launch sites from those alone, since Python-side key building costs the host too. Only where
graphs can be captured and replayed: on CUDA, and not while the current stream is itself being
captured (then the launch simply becomes part of that graph). At most ``max_graphs`` keys are
captured; past that, or if a capture fails, launches run as they are.
``GEMMA4_SPEC_GRAPHED_LAUNCHES=0`` turns the graphs off (every launch runs as it is).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from gemma4_spec.log import get_logger
from gemma4_spec.switches import turned_off

logger = get_logger(__name__)
GRAPHED_LAUNCHES_ENV = "GEMMA4_SPEC_GRAPHED_LAUNCHES"
_captures_in_process = 0  # graphs captured by every launch site of this process so far


def captures_in_process() -> int:
    """How many launch graphs this process has captured, over every launch site: the count
    before and after serving tells whether any was captured in a request's path."""
    return _captures_in_process


class GraphedLaunches:
    """One kernel launch site's captured graphs, by key."""

    def __init__(self, name: str, max_graphs: int = 32) -> None:
        self.name = name
        self.max_graphs = max_graphs
        self.replays = 0
        off = turned_off(GRAPHED_LAUNCHES_ENV)
        self.disabled: str | None = f"{GRAPHED_LAUNCHES_ENV}=0" if off else None
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, launch: Callable[[], object], device: torch.device) -> None:
        if (
            device.type != "cuda"
            or self.disabled is not None
            or torch.cuda.is_current_stream_capturing()  # no replay inside another capture
        ):
            launch()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            self.replays += 1
            graph.replay()
            return
        launch()  # this call's results (and any compilation), as it is
        if len(self._graphs) < self.max_graphs:
            self._capture(key, launch)

    def _capture(self, key: Hashable, launch: Callable[[], object]) -> None:
        """Captures ``launch`` on a side stream. Unlike ``torch.cuda.graph``, no device-wide
        synchronisation, garbage collection or cache emptying: this runs while serving."""
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=main.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except Exception as exc:  # keep serving: the plain launch computes the same
            self.disabled = f"{type(exc).__name__}: {exc}"
            self._graphs.clear()
            logger.warning(
                "gemma4_spec: %s launches are not replayed from graphs (capture failed: %s)",
                self.name,
                self.disabled,
            )
            return
        finally:
            main.wait_stream(side)
        self._graphs[key] = graph
        global _captures_in_process
        _captures_in_process += 1
