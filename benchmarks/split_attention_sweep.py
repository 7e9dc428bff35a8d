"""Block sizes of our split verification attention (``ops/split_attention_triton.py``), swept
on a GPU: keys a step (``TILE``), keys a segment at least (``min_keys``), warps and pipeline
stages, on one E2B-like layer (8 query heads, 1 KV head, block size 16, bf16; head 256 with a
512-token window, or head 512 with full attention), ``1 + k`` query tokens a request. Needs
CUDA and triton, not vLLM (``verify_attention.py`` puts the chosen sizes beside vLLM's kernels).

Each variant in a CUDA graph, cold L2 (``centroid_argmax.py``'s harness), median of ``--reps``
replays, in us; a ``!`` marks a variant whose output strays from the torch reference
(``split_attention_reference``) by more than bf16 rounding. The last column is the fastest
variant of each row, the first is the defaults.

``--scratch-width N`` replaces the sweep by the defaults on three scratches: one as wide as the
head (``head``), one ``N`` wide as vLLM's in the engine (``wide``: Gemma 4's is 512 on every
layer), and the same with tiles ``N`` wide (``wide tiles``: the launch before 906c07d, which
took its tiles' width from the scratch).

    python benchmarks/split_attention_sweep.py [--batch 1,8,16,32,64] [--context 256,2048]
        [--k 3] [--reps 100] [--scratch-width 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import _time_cuda, relative_scores  # noqa: E402

from gemma4_spec.ops.split_attention import split_attention_reference  # noqa: E402
from gemma4_spec.ops.split_attention_triton import (  # noqa: E402
    SplitAttentionConfig,
    SplitAttentionScratch,
    prepare_split_attention,
    split_attention,
    split_attention_config,
    split_attention_scratch,
)

HEADS, KV_HEADS, BLOCK = 8, 1, 16
LAYERS = {"sliding-256": (256, 512), "full-512": (512, 0)}
TILES = (16, 32, 64)
MIN_KEYS = (32, 64, 128, 256)
WARPS = (4, 8)
STAGES = (1, 2)


def _variants(defaults: SplitAttentionConfig) -> list[SplitAttentionConfig]:
    grid = itertools.product(TILES, MIN_KEYS, WARPS, STAGES)
    others = [
        defaults._replace(tile=t, min_keys=m, num_warps=w, num_stages=s) for t, m, w, s in grid
    ]
    return [defaults, *(c for c in others if c != defaults)]


def _label(c: SplitAttentionConfig) -> str:
    return f"t{c.tile}/m{c.min_keys}/w{c.num_warps}/s{c.num_stages}"


def _width_variants(
    defaults: SplitAttentionConfig, head_wide: SplitAttentionScratch, width: int
) -> list[tuple[str, SplitAttentionConfig, SplitAttentionScratch]]:
    """The defaults on ``head_wide`` and on a scratch ``width`` wide, and that with wide tiles."""
    tokens, heads, _, head = head_wide.values.shape
    wide = split_attention_scratch(tokens, heads, head, head_wide.values.device, width)
    return [
        ("head", defaults, head_wide),
        ("wide", defaults, wide),
        ("wide tiles", defaults._replace(head_pad=max(defaults.head_pad, width)), wide),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,16,32,64")
    parser.add_argument("--context", default="256,2048")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--scratch-width", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    prepare_split_attention(device)
    q_len = 1 + args.k
    rows = []
    for name, (head_dim, window) in LAYERS.items():
        defaults = split_attention_config(q_len, HEADS // KV_HEADS, head_dim)
        for context in (int(c) for c in args.context.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                blocks = (context + q_len + BLOCK - 1) // BLOCK
                shape = (batch * blocks + 1, BLOCK, KV_HEADS, head_dim)
                keys = torch.randn(shape, device=device).bfloat16()
                values = torch.randn(shape, device=device).bfloat16()
                table = (torch.arange(batch * blocks, device=device) + 1).view(batch, blocks)
                table = table.int()
                q = torch.randn(batch * q_len, HEADS, head_dim, device=device).bfloat16()
                starts = (torch.arange(batch + 1, device=device) * q_len).int()
                seq_lens = torch.full((batch,), context + q_len, device=device).int()
                scratch = split_attention_scratch(batch * q_len, HEADS, head_dim, device)
                variants = (
                    _width_variants(defaults, scratch, args.scratch_width)
                    if args.scratch_width
                    else [(_label(c), c, scratch) for c in _variants(defaults)]
                )
                scale = head_dim**-0.5
                want = split_attention_reference(
                    q.float(), keys.float(), values.float(), table, seq_lens, starts, scale,
                    window,
                )  # fmt: skip
                times: dict[str, float] = {}
                for label, config, space in variants:
                    out = torch.empty_like(q)

                    run = functools.partial(
                        split_attention, q, keys, values, table, seq_lens, starts, q_len, scale,
                        window, out=out, scratch=space, config=config,
                    )  # fmt: skip
                    run()
                    torch.cuda.synchronize()
                    wrong = (out.float() - want).abs().max().item() > 2e-2
                    us = _time_cuda(run, args.reps, flush)
                    times[label + ("!" if wrong else "")] = us
                if args.scratch_width:
                    print(
                        f"{name:12s} B={batch:3d} ctx={context:5d}  "
                        + "  ".join(f"{label} {us:7.1f}" for label, us in times.items()),
                        flush=True,
                    )
                    rows.append(dict(layer=name, batch=batch, context=context, k=args.k, us=times))
                    continue
                best = min(times, key=times.__getitem__)
                first = next(iter(times))
                print(
                    f"{name:12s} B={batch:3d} ctx={context:5d}  defaults {first} "
                    f"{times[first]:7.1f}  best {best} {times[best]:7.1f}",
                    flush=True,
                )
                rows.append(dict(layer=name, batch=batch, context=context, k=args.k, us=times))
    # Per layer, over its shapes: the variants by their time relative to each row's best.
    for name in LAYERS:
        score = relative_scores([row["us"] for row in rows if row["layer"] == name])
        print(f"\n{name}: variants by mean time over each row's best (1.00 = best everywhere)")
        for label in sorted(score, key=score.__getitem__)[:10]:
            print(f"  {label:22s} {score[label]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
