"""Attention of one target layer in a verification step, through vLLM's Triton kernel: as vLLM
runs it (requests of ``1 + k`` query tokens: its one-pass "2D" kernel) and the same requests
through its split-key "3D" kernel (``max_query_len`` 1: what ``patch/patch_triton_attn.py``
does), with a plain decode step (one query token per request) for scale, through vLLM's pick
(the split kernel up to its threshold of sequences) and through the one-pass kernel
(``dec. 2D``). Needs CUDA and vLLM.

E2B-like layer: 8 query heads, 1 KV head, head size 256 (sliding window 512) or 512 (full
attention), block size 16, bf16. Each variant in a CUDA graph, cold L2 (``centroid_argmax``'s
harness), median of ``--reps`` replays, in us. ``split s=N``: the split kernel with N softmax
segments instead of vLLM's 16 (``GEMMA4_SPEC_VERIFY_SEGMENTS``; ``-``/NaN where its scratch
cannot hold the batch); ``ours``: ``ops/split_attention_triton.py`` (segments over the keys the
request attends, picked from their count, summed by the last segment program: one launch), on
a scratch as wide as the engine's (vLLM's, sized for the largest head: 512 on the sliding
layers too).
Last, a table of what those rows add up to in a step of E2B's target (28 sliding and 7 full
layers) for each kernel choice on the sliding and the full layers.

    python benchmarks/verify_attention.py --batch 1,8,32 --context 256,2048 --k 3 \
        --segments 8,4,2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from centroid_argmax import _time_cuda  # noqa: E402

from gemma4_spec.ops.split_attention_triton import (  # noqa: E402
    prepare_split_attention,
    split_attention,
    split_attention_scratch,
)
from gemma4_spec.testing.triton_attention import (  # noqa: E402
    SEGMENTS,
    THRESHOLD_3D,
    PagedAttention,
)

HEADS, KV_HEADS, BLOCK = 8, 1, 16
LAYERS = {"sliding-256": (256, 512), "full-512": (512, 0)}
E2B_LAYERS = {"sliding-256": 28, "full-512": 7}  # the target's layers of each kind
SCRATCH_HEAD = max(head for head, _ in LAYERS.values())  # vLLM sizes its scratch for this


def _measure(
    head_dim: int, window: int, context: int, batch: int, q_len: int, reps: int,
    flush: torch.Tensor, segment_counts: list[int],
) -> dict[str, float]:  # fmt: skip
    """us of each variant for one layer shape (NaN where the scratch cannot hold the batch)."""
    device = flush.device
    blocks = (context + q_len + BLOCK - 1) // BLOCK
    cache = torch.randn(batch * blocks + 1, BLOCK, KV_HEADS, head_dim, device=device).bfloat16()
    table = (torch.arange(batch * blocks, device=device) + 1).view(batch, blocks).int()
    attention = PagedAttention(cache, cache, HEADS, window)

    def attend(q, starts, max_q, seq_lens, block_table, split=True):  # type: ignore[no-untyped-def]
        return attention(q, starts, max_q, seq_lens, block_table, context + q_len, split_keys=split)

    verify_q = torch.randn(batch * q_len, HEADS, head_dim, device=device).bfloat16()
    starts = (torch.arange(batch + 1, device=device) * q_len).int()
    seq_lens = torch.full((batch,), context + q_len, device=device).int()
    decode_starts = torch.arange(batch + 1, device=device).int()

    def split(segments: int) -> float:
        if batch * q_len > THRESHOLD_3D * SEGMENTS // segments:
            return float("nan")
        return _time_cuda(
            lambda: attention(
                verify_q, starts, 1, seq_lens, table, context + q_len, segments=segments
            ),
            reps,
            flush,
        )

    # vLLM's scratch, which ours reuses in the engine, is as wide as the model's largest head.
    ours_scratch = split_attention_scratch(batch * q_len, HEADS, head_dim, device, SCRATCH_HEAD)
    prepare_split_attention(device)

    def ours() -> torch.Tensor:
        return split_attention(
            verify_q, cache, cache, table, seq_lens, starts, q_len, head_dim**-0.5, window,
            scratch=ours_scratch,
        )  # fmt: skip

    return {
        "vllm_2d": _time_cuda(
            lambda: attend(verify_q, starts, q_len, seq_lens, table), reps, flush
        ),
        "split_3d": split(SEGMENTS),
        "ours": _time_cuda(ours, reps, flush),
        **{f"split_3d_s{n}": split(n) for n in segment_counts if n != SEGMENTS},
        "decode": _time_cuda(
            lambda: attend(verify_q[:batch], decode_starts, 1, seq_lens, table), reps, flush
        ),
        # The same one-query step through the one-pass kernel (a draft step's attention).
        "decode_2d": _time_cuda(
            lambda: attend(verify_q[:batch], decode_starts, 1, seq_lens, table, False),
            reps,
            flush,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", default="256,2048")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--segments", default="8,4,2", help="split kernel segments besides 16")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    counts = [int(n) for n in args.segments.split(",") if n]
    rows = []
    extra = "".join(f"{f'split s={n}':>10s}" for n in counts)
    print(
        f"{'layer':12s} {'B':>3s} {'ctx':>5s} {'vLLM 2D':>8s} {'split 3D':>8s}{extra} {'ours':>8s} "
        f"{'decode':>8s} {'dec. 2D':>8s}"
    )
    for name, (head_dim, window) in LAYERS.items():
        for context in (int(c) for c in args.context.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                q_len = 1 + args.k
                times = _measure(head_dim, window, context, batch, q_len, args.reps, flush, counts)
                extra = "".join(f"{times[f'split_3d_s{n}']:10.1f}" for n in counts)
                print(
                    f"{name:12s} {batch:3d} {context:5d} {times['vllm_2d']:8.1f} "
                    f"{times['split_3d']:8.1f}{extra} {times['ours']:8.1f} {times['decode']:8.1f} "
                    f"{times['decode_2d']:8.1f}",
                    flush=True,
                )
                rows.append(dict(layer=name, batch=batch, context=context, k=args.k, **times))
    _print_policies(rows, counts)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _print_policies(rows: list[dict], counts: list[int]) -> None:
    """Verification attention a step of E2B's layers (``E2B_LAYERS``) under each choice of
    kernel for the sliding and the full layers: vLLM's split kernel at its 16 or at N segments
    (``sN``; its one-pass kernel where the split's scratch cannot hold the batch) or ours."""

    def time(row: dict, kernel: str) -> float:
        value = row["ours" if kernel == "ours" else "split_3d" + kernel.removeprefix("16")]
        return row["vllm_2d"] if value != value else value  # NaN: the one-pass kernel runs it

    kernels = ["16", *(f"_s{n}" for n in counts if n != SEGMENTS), "ours"]
    policies = [(a, b) for a in kernels for b in kernels]
    by = {(r["layer"], r["batch"], r["context"]): r for r in rows}
    label = {"16": "16", "ours": "ours", **{f"_s{n}": f"s{n}" for n in counts}}
    names = [f"{label[a]}/{label[b]}" for a, b in policies]
    print("\nus a step, E2B's 28 sliding / 7 full layers, kernel on each (sliding/full):")
    print(f"{'B':>3s} {'ctx':>5s} " + " ".join(f"{n:>10s}" for n in names))
    for batch, context in sorted({(r["batch"], r["context"]) for r in rows}):
        sliding, full = (
            by.get(("sliding-256", batch, context)),
            by.get(("full-512", batch, context)),
        )
        if sliding is None or full is None:
            continue
        sums = [
            E2B_LAYERS["sliding-256"] * time(sliding, a) + E2B_LAYERS["full-512"] * time(full, b)
            for a, b in policies
        ]
        print(f"{batch:3d} {context:5d} " + " ".join(f"{x:10.0f}" for x in sums), flush=True)


if __name__ == "__main__":
    main()
