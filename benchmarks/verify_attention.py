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

``--chain N`` times each variant as the engine runs it instead: N calls back to back in one
graph, each on its own layer's cache and queries (no cold-L2 flush, no graph launch per call;
us a call). ``--ours m128,m1024_w4`` adds columns of our kernel at other sizes
(``ours_<label>``); ``decode_ours`` is ours on a one-query batch (a draft step's attention).

    python benchmarks/verify_attention.py --batch 1,8,32 --context 256,2048 --k 3 \
        --segments 8,4,2 [--chain 28] [--ours m128,m1024_w4] --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from centroid_argmax import _time_cuda, _time_cuda_chain  # noqa: E402

from gemma4_spec.ops.split_attention_triton import (  # noqa: E402
    prepare_split_attention,
    split_attention,
    split_attention_config,
    split_attention_scratch,
    with_sizes,
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
    flush: torch.Tensor, segment_counts: list[int], chain: int = 0,
    ours_labels: tuple[str, ...] = (),
) -> dict[str, float]:  # fmt: skip
    """us of each variant for one layer shape (NaN where the scratch cannot hold the batch).
    ``chain`` > 0: each variant as ``chain`` calls in one graph, each on a layer of its own
    (``_time_cuda_chain``), instead of one call a graph on a cold L2."""
    device = flush.device
    blocks = (context + q_len + BLOCK - 1) // BLOCK
    table = (torch.arange(batch * blocks, device=device) + 1).view(batch, blocks).int()
    starts = (torch.arange(batch + 1, device=device) * q_len).int()
    seq_lens = torch.full((batch,), context + q_len, device=device).int()
    decode_starts = torch.arange(batch + 1, device=device).int()
    # vLLM's scratch, which ours reuses in the engine, is as wide as the model's largest head.
    ours_scratch = split_attention_scratch(batch * q_len, HEADS, head_dim, device, SCRATCH_HEAD)
    prepare_split_attention(device)
    layers = []
    shape = (batch * blocks + 1, BLOCK, KV_HEADS, head_dim)
    for _ in range(max(chain, 1)):
        # Keys and values apart, as in the engine (one tensor for both would read the values
        # from L2 right after the keys).
        keys = torch.randn(shape, device=device).bfloat16()
        values = torch.randn(shape, device=device).bfloat16()
        verify_q = torch.randn(batch * q_len, HEADS, head_dim, device=device).bfloat16()
        layers.append((keys, values, verify_q, PagedAttention(keys, values, HEADS, window)))

    def timed(make: Callable[[int], Callable[[], torch.Tensor]]) -> float:
        if chain:
            return _time_cuda_chain([make(i) for i in range(chain)], reps)
        return _time_cuda(make(0), reps, flush)

    def vllm(segments: int = SEGMENTS, split: bool = True, decode: bool = False) -> float:
        if split and not decode and batch * q_len > THRESHOLD_3D * SEGMENTS // segments:
            return float("nan")

        def make(i: int) -> Callable[[], torch.Tensor]:
            _, _, q, attention = layers[i]
            if decode:
                return lambda: attention(
                    q[:batch], decode_starts, 1, seq_lens, table, context + q_len,
                    split_keys=split,
                )  # fmt: skip
            if split:  # every query token as its own one-query request: the split kernel
                return lambda: attention(
                    q, starts, 1, seq_lens, table, context + q_len, segments=segments
                )
            return lambda: attention(
                q, starts, q_len, seq_lens, table, context + q_len, split_keys=False
            )

        return timed(make)

    def ours(label: str = "", decode: bool = False) -> float:
        rows = 1 if decode else q_len
        config = with_sizes(split_attention_config(rows, HEADS // KV_HEADS, head_dim), label)

        def make(i: int) -> Callable[[], torch.Tensor]:
            keys, values, q, _ = layers[i]
            if decode:
                return lambda: split_attention(
                    q[:batch], keys, values, table, seq_lens, decode_starts, 1, head_dim**-0.5,
                    window, scratch=ours_scratch, config=config,
                )  # fmt: skip
            return lambda: split_attention(
                q, keys, values, table, seq_lens, starts, q_len, head_dim**-0.5, window,
                scratch=ours_scratch, config=config,
            )  # fmt: skip

        return timed(make)

    return {
        "vllm_2d": vllm(split=False),
        "split_3d": vllm(),
        "ours": ours(),
        **{f"split_3d_s{n}": vllm(n) for n in segment_counts if n != SEGMENTS},
        **{f"ours_{label}": ours(label) for label in ours_labels},
        "decode": vllm(decode=True),
        # The same one-query step through the one-pass kernel (a draft step's attention).
        "decode_2d": vllm(split=False, decode=True),
        "decode_ours": ours(decode=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", default="256,2048")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--segments", default="8,4,2", help="split kernel segments besides 16")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument(
        "--chain",
        type=int,
        default=0,
        help="N > 0: each variant as N calls in one graph, a layer each (as among the model's "
        "layers), not one call a graph on a cold L2",
    )
    parser.add_argument(
        "--ours",
        default="",
        help="more columns of our kernel with other sizes (ops/split_attention_triton.py's "
        "parse_sizes), e.g. m128,m1024_w4 (t: keys a tile, m: keys a segment at least, "
        "w: warps, s: stages)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    counts = [int(n) for n in args.segments.split(",") if n]
    labels = tuple(label for label in args.ours.split(",") if label)
    rows = []
    header = False
    for name, (head_dim, window) in LAYERS.items():
        for context in (int(c) for c in args.context.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                q_len = 1 + args.k
                times = _measure(
                    head_dim, window, context, batch, q_len, args.reps, flush, counts,
                    args.chain, labels,
                )  # fmt: skip
                if not header:
                    print(f"{'layer':12s} {'B':>3s} {'ctx':>5s} " + " ".join(
                        f"{column:>11s}" for column in times
                    ))  # fmt: skip
                    header = True
                print(
                    f"{name:12s} {batch:3d} {context:5d} "
                    + " ".join(f"{us:11.1f}" for us in times.values()),
                    flush=True,
                )
                rows.append(dict(layer=name, batch=batch, context=context, k=args.k, **times))
    _print_policies(rows, counts)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def split_time(row: dict, key: str = "split_3d") -> float:
    """A row's time for vLLM's split kernel (``key``: its column), or for its one-pass kernel
    where the split's scratch could not hold the batch (the split's time is NaN)."""
    value = row[key]
    return row["vllm_2d"] if value != value else value


def _print_policies(rows: list[dict], counts: list[int]) -> None:
    """Verification attention a step of E2B's layers (``E2B_LAYERS``) under each choice of
    kernel for the sliding and the full layers: vLLM's split kernel at its 16 or at N segments
    (``sN``; its one-pass kernel where the split's scratch cannot hold the batch) or ours."""

    def time(row: dict, kernel: str) -> float:
        return split_time(
            row, "ours" if kernel == "ours" else "split_3d" + kernel.removeprefix("16")
        )

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
