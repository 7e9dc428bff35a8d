"""Upload Model Runner V2's start-up CUDA graphs to the device before the first request.

A captured graph's first launch costs the GPU more than its later ones, about 1.6-2 us a
kernel: the driver uploads the executable graph then (``benchmarks/graph_first_replay.py``).
vLLM's V2 graph managers capture without replaying, so each graph's first replay, the target's
for every padded batch size and our draft loop's, fell in a user's first pass at that size.
The driver's ``cuGraphUpload`` does that work at start-up and runs nothing, so no buffer or KV
cache changes. ``GEMMA4_SPEC_GRAPH_UPLOAD=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gemma4_spec.log import get_logger
from gemma4_spec.switches import turned_off

GRAPH_UPLOAD_ENV = "GEMMA4_SPEC_GRAPH_UPLOAD"
Upload = Callable[[torch.cuda.CUDAGraph, int], None]

logger = get_logger(__name__)


def runner_graphs(model_runner: Any) -> list[torch.cuda.CUDAGraph]:
    """The full CUDA graphs of a V2 runner's graph managers: the target's and those of its
    speculator (any of its attributes with a ``graphs`` dict of graphs). Piecewise graphs live in
    the compiled model, not here: they serve mixed batches, not the decode steps."""
    managers = [getattr(model_runner, "cudagraph_manager", None)]
    speculator = getattr(model_runner, "speculator", None)
    if speculator is not None:
        managers += list(vars(speculator).values())
    graphs: list[torch.cuda.CUDAGraph] = []
    for manager in managers:
        held = getattr(manager, "graphs", None)
        if isinstance(held, dict):
            graphs += [g for g in held.values() if callable(getattr(g, "replay", None))]
    return graphs


def upload_graphs(graphs: Iterable[torch.cuda.CUDAGraph], upload: Upload | None = None) -> int:
    """Uploads each graph on the current stream, then waits for the uploads; returns how many
    were uploaded. A failure is logged and ends the uploads (a graph not uploaded is uploaded
    by its first replay, as without this)."""
    upload = upload or _driver_upload
    stream = torch.cuda.current_stream()
    done = 0
    for graph in graphs:
        try:
            upload(graph, stream.cuda_stream)
        except (OSError, RuntimeError, AttributeError) as exc:
            logger.warning("gemma4_spec: CUDA graphs not uploaded at start-up (%s)", exc)
            break
        done += 1
    stream.synchronize()
    return done


def upload_runner_graphs(model_runner: Any, upload: Upload | None = None) -> int:
    """Uploads a V2 runner's full graphs (see the module's docstring); 0 where it is off or
    the runner is not on CUDA."""
    device = getattr(model_runner, "device", None)
    if turned_off(GRAPH_UPLOAD_ENV) or device is None or torch.device(device).type != "cuda":
        return 0
    done = upload_graphs(runner_graphs(model_runner), upload)
    logger.info("gemma4_spec: %d CUDA graphs uploaded to the device at start-up", done)
    return done


def _driver_upload(graph: torch.cuda.CUDAGraph, stream: int) -> None:
    """``cuGraphUpload`` of the graph's executable (torch's ``cudaGraphExec_t`` is the
    driver's ``CUgraphExec``)."""
    result = _libcuda().cuGraphUpload(
        ctypes.c_void_p(graph.raw_cuda_graph_exec()), ctypes.c_void_p(stream)
    )
    if result != 0:
        raise RuntimeError(f"cuGraphUpload returned CUresult {result}")


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")
