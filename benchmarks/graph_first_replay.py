"""What the first replay of a captured CUDA graph costs against its later replays.

Every engine's first pass at a new batch size replays graphs captured at start-up but never
replayed: on Model Runner V2, the target's graph of each padded size the batch passes through
(its requests finish at different steps), and ours' draft-loop graphs, which vLLM's graph
manager captures (ours' verification graphs are launched once when captured). If a graph's
first replay costs milliseconds (the driver uploading it to the device on its first launch), a
first pass pays it once for every size it meets, in every engine, which would fit first passes
slower than the passes right after them with no lazy work recorded. This captures
``--graphs`` graphs of ``--nodes`` kernels each (small matmuls and elementwise kernels, in one
memory pool as vLLM's are), then times each graph's first replay and its next ones (host wall
time to the end of the GPU's work, and CUDA events). ``--upload`` captures a second set of
the same graphs beside the first and uploads each right after its capture through the
plugin's start-up upload (``spec_decode/graph_upload.py``: the driver's ``cuGraphUpload``,
nothing runs): whether that moves the first replay's extra cost out of the first pass. Needs
torch, CUDA and this package on the path, not vLLM.

    python benchmarks/graph_first_replay.py [--nodes 100,400,1200] [--graphs 8] [--upload]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gemma4_spec.spec_decode.graph_upload import upload_graphs


def _step(x: torch.Tensor, ws: list[torch.Tensor], nodes: int) -> torch.Tensor:
    """``nodes`` kernels: a small matmul, then two elementwise kernels, in turn."""
    for i in range(nodes):
        x = x @ ws[i % len(ws)] if i % 3 == 0 else torch.tanh(x)
    return x


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Host wall ms to the end of the GPU's work, and CUDA-event ms, of one call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return (time.perf_counter() - t0) * 1e3, start.elapsed_time(end)


def _capture(
    nodes: int, count: int, ws: list[torch.Tensor], upload: bool
) -> tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]:
    """``count`` graphs of ``nodes`` kernels in one pool, and the inputs they read."""
    graphs, inputs = [], []  # the inputs too: each graph reads its own from its capture
    pool = torch.cuda.graph_pool_handle()
    for g in range(count):
        x = torch.randn(8 * (g + 1), 256, device=ws[0].device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as vLLM does
            _step(x, ws, nodes)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            _step(x, ws, nodes)
        if upload and upload_graphs([graph]) != 1:  # the plugin's start-up upload
            raise SystemExit("cuGraphUpload failed (the warning above says why)")
        graphs.append(graph)
        inputs.append(x)
    torch.cuda.synchronize()
    return graphs, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,400,1200")
    parser.add_argument("--graphs", type=int, default=8)
    parser.add_argument("--replays", type=int, default=5, help="timed replays after the first")
    parser.add_argument("--upload", action="store_true", help="also uploaded graphs, beside")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    dev = torch.device("cuda")
    ws = [torch.randn(256, 256, device=dev) / 16 for _ in range(4)]
    rows = []
    print("graph replays, ms: first / median of the next (host wall; CUDA events)")
    for nodes in [int(n) for n in args.nodes.split(",")]:
        sets = {"as captured": _capture(nodes, args.graphs, ws, upload=False)}
        if args.upload:
            sets["uploaded"] = _capture(nodes, args.graphs, ws, upload=True)
        for label, (graphs, _inputs) in sets.items():
            rows.append(_time_firsts(label, nodes, graphs, args.replays))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _time_firsts(
    label: str, nodes: int, graphs: list[torch.cuda.CUDAGraph], replays: int
) -> dict[str, object]:
    """Each graph's first replay and the median of its next ``replays``; prints the medians."""
    firsts, nexts = [], []
    for graph in graphs:
        first = _timed(graph.replay)
        later = [_timed(graph.replay) for _ in range(replays)]
        firsts.append(first)
        nexts.append(
            (statistics.median(t[0] for t in later), statistics.median(t[1] for t in later))
        )
    f_wall = statistics.median(f[0] for f in firsts)
    f_ev = statistics.median(f[1] for f in firsts)
    n_wall = statistics.median(n[0] for n in nexts)
    n_ev = statistics.median(n[1] for n in nexts)
    print(
        f"  {nodes:5d} kernels, {label:11s}: first {f_wall:7.3f} / next {n_wall:7.3f} "
        f"(events {f_ev:7.3f} / {n_ev:7.3f}); first minus next {f_wall - n_wall:6.3f} ms "
        f"over {len(graphs)} graphs (max first {max(f[0] for f in firsts):.3f})"
    )
    return {
        "nodes": nodes,
        "set": label,
        "first": firsts,
        "next": nexts,
        "first_minus_next_ms": f_wall - n_wall,
    }


if __name__ == "__main__":
    main()
