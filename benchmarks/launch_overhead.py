"""Host cost of launching our small per-step kernels, against replaying them from a CUDA graph.

Every draft replay launches the input-staging kernel once: a small kernel whose GPU time is a
microsecond or two, launched from Python through Triton's JIT dispatch, on a step the host
bounds at small batches. This times, per call, the host CPU of
(a) the plain Triton launch, (b) the call as the plugin makes it (``ops/graphed_launch.py``: a
key, then a CUDA-graph replay of the launch), (c) the bare graph replay, and (d) one small
torch op, for scale. Needs torch, triton and CUDA only.

    python benchmarks/launch_overhead.py [--reps 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4_spec.ops.draft_inputs import (  # noqa: E402
    DraftStepBuffers,
    DraftStepSources,
    stage_draft_inputs,
)
from gemma4_spec.ops.graphed_launch import GraphedLaunches  # noqa: E402


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Host CPU time per call of ``fn`` (the GPU runs behind it), after a warm-up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.process_time()
    for _ in range(reps):
        fn()
    spent = time.process_time() - start
    torch.cuda.synchronize()
    return spent / reps * 1e6


def gpu_us(fn: Callable[[], object], reps: int) -> float:
    """GPU time per call of ``fn``, timed with CUDA events around ``reps`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    dev = torch.device("cuda")
    b, q, width = 1, 3, 32  # batch 1, k = 2
    seq_lens = torch.full((b,), 200, dtype=torch.int32, device=dev)
    table = torch.randint(1, 999, (b, width), dtype=torch.int32, device=dev)
    hidden = torch.randn(b * q, 1536, dtype=torch.bfloat16, device=dev)
    src = DraftStepSources(
        next_token_ids=torch.zeros(b, dtype=torch.int32, device=dev),
        positions=torch.arange(b * q, device=dev),
        hidden=hidden,
        rows=torch.full((b,), q - 1, dtype=torch.int32, device=dev),
        seq_lens=seq_lens,
        rejected=torch.zeros(b, dtype=torch.int32, device=dev),
        tables=(table, table),
    )
    out = DraftStepBuffers(
        input_ids=torch.zeros(64, dtype=torch.int32, device=dev),
        positions=torch.zeros(64, dtype=torch.long, device=dev),
        hidden=torch.zeros(64, 1536, dtype=torch.bfloat16, device=dev),
        seq_lens=torch.zeros(64, dtype=torch.int32, device=dev),
        tables=tuple(torch.zeros(64, width, dtype=torch.int32, device=dev) for _ in range(2)),
    )

    launches = GraphedLaunches("staging")

    def stage_plain() -> None:
        stage_draft_inputs(src, out, b, b)

    def stage() -> None:
        stage_draft_inputs(src, out, b, b, launches)

    small = torch.zeros(64, dtype=torch.int32, device=dev)
    print("host CPU per call, us: plain Triton launch / as the plugin calls it / bare replay")
    cells = [host_us(stage_plain, args.reps), host_us(stage, args.reps)]
    cells.append(host_us(graphed(stage_plain), args.reps))
    print(f"  {'stage_draft_inputs':20s} " + " / ".join(f"{c:6.1f}" for c in cells))
    print(f"  {'torch fill_':20s} {host_us(lambda: small.fill_(1), args.reps):6.1f}")


if __name__ == "__main__":
    main()
