"""Staging a draft-loop graph's inputs: one Triton launch (``ops/draft_inputs.py``) against the
torch ops it replaced (gathers, copies and fills, one launch each), on the host and the GPU.

The staging runs before every draft-loop replay, on a step whose time the host bounds at small
batches, so the host's cost per call is the figure that matters: it is timed as the CPU time of
the calls (the GPU runs behind them); the GPU time per call is timed apart with CUDA events.
E2B shapes: target hidden 1536, k = 2 (3 query tokens per request), two KV cache groups.

    python benchmarks/draft_inputs.py [--batch 1,8,32] [--width 32,2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_overhead import gpu_us, host_us  # noqa: E402

from gemma4_spec.ops.draft_inputs import (  # noqa: E402
    NULL_BLOCK_ID,
    DraftStepBuffers,
    DraftStepSources,
    stage_draft_inputs,
)
from gemma4_spec.spec_decode.draft_graphs import loop_graph_size  # noqa: E402

HIDDEN, Q_LEN, CAPACITY = 1536, 3, 64


def torch_ops(src: DraftStepSources, out: DraftStepBuffers, batch: int, size: int) -> None:
    """The staging as separate torch ops (as the proposer did before the fused kernel)."""
    out.input_ids[:batch] = src.next_token_ids[:batch]
    out.positions[:batch] = src.positions[src.rows[:batch]]
    out.hidden[:batch] = src.hidden[src.rows[:batch]]
    seq_lens = out.seq_lens[:size]
    assert src.rejected is not None
    torch.sub(src.seq_lens[:batch], src.rejected[:batch], out=seq_lens[:batch])
    seq_lens[batch:].fill_(1)
    for table, source in zip(out.tables, src.tables, strict=True):
        table[:batch].copy_(source[:batch])
        table[batch:size].fill_(NULL_BLOCK_ID)


def make(batch: int, width: int) -> tuple[DraftStepSources, DraftStepBuffers]:
    dev = torch.device("cuda")
    n = batch * Q_LEN
    src = DraftStepSources(
        next_token_ids=torch.randint(0, 262144, (batch,), dtype=torch.int32, device=dev),
        positions=torch.arange(n, device=dev),
        hidden=torch.randn(n, HIDDEN, dtype=torch.bfloat16, device=dev),
        rows=torch.arange(batch, dtype=torch.int32, device=dev) * Q_LEN + Q_LEN - 1,
        seq_lens=torch.full((batch,), 300, dtype=torch.int32, device=dev),
        rejected=torch.full((batch,), Q_LEN - 1, dtype=torch.int32, device=dev),
        tables=tuple(
            torch.randint(1, 9999, (CAPACITY, width), dtype=torch.int32, device=dev)
            for _ in range(2)
        ),
    )
    out = DraftStepBuffers(
        input_ids=torch.zeros(CAPACITY, dtype=torch.int32, device=dev),
        positions=torch.zeros(CAPACITY, dtype=torch.long, device=dev),
        hidden=torch.zeros(CAPACITY, HIDDEN, dtype=torch.bfloat16, device=dev),
        seq_lens=torch.zeros(CAPACITY, dtype=torch.int32, device=dev),
        tables=tuple(torch.zeros(CAPACITY, width, dtype=torch.int32, device=dev) for _ in range(2)),
    )
    return src, out


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(host us per call, GPU us per call)."""
    return host_us(fn, reps), gpu_us(fn, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--width", default="32,2048", help="block-table widths")
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'B':>3} {'rows':>4} {'width':>5} | host us: torch ops / fused | GPU us: torch / fused")
    for width in map(int, args.width.split(",")):
        for batch in map(int, args.batch.split(",")):
            size = loop_graph_size(batch, CAPACITY)
            src, out = make(batch, width)
            ops = timed(lambda: torch_ops(src, out, batch, size), args.reps)  # noqa: B023
            fused = timed(lambda: stage_draft_inputs(src, out, batch, size), args.reps)  # noqa: B023
            rows.append(dict(batch=batch, size=size, width=width, torch_ops=ops, fused=fused))
            print(
                f"{batch:3d} {size:4d} {width:5d} | {ops[0]:8.1f} / {fused[0]:6.1f}"
                f"          | {ops[1]:6.1f} / {fused[1]:6.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
