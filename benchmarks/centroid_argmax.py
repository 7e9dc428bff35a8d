"""Greedy draft sampling at real Gemma 4 assistant dimensions: ours vs the torch reference vs
vLLM's in-tree formula vs a full-vocab argmax, side by side in one run.

    .venv/bin/python benchmarks/centroid_argmax.py [--device cpu|cuda] [--dtype float32|bfloat16]

Prints median microseconds per call and each method's time as a ratio of ours. On CUDA the
calls are timed with events after warm-up; the fused GPU kernel comes with the GPU issue, so
today "ours" is the eager sparse path everywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gemma4_spec.ops.centroid_argmax import (
    CentroidMask,
    centroid_argmax,
    centroid_argmax_reference,
)

VOCAB, CENTROIDS, TOP_K, HIDDEN = 262144, 2048, 32, 256  # E2B/E4B assistants


def in_tree_formula():  # type: ignore[no-untyped-def]
    """vLLM's own masked embedder (its get_top_tokens), called as-is for comparison."""
    from vllm.model_executor.models.gemma4_mtp import Gemma4MTPMaskedEmbedder

    return Gemma4MTPMaskedEmbedder


def _time(fn, device: torch.device, reps: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen).to(device, dtype)
    centroid_w = torch.randn(CENTROIDS, HIDDEN, generator=gen).to(device, dtype)
    ordering = torch.randperm(VOCAB, generator=gen).to(device)
    mask = CentroidMask(centroid_w, ordering, TOP_K)

    embedder = None
    try:
        embedder = in_tree_formula()(HIDDEN, VOCAB, CENTROIDS, TOP_K).to(device, dtype)
        embedder.centroids.weight.data.copy_(centroid_w)
        embedder.token_ordering.copy_(ordering)
    except ImportError:
        print("(vLLM's in-tree gemma4_mtp not importable: its column is skipped)")

    print(f"device={device} dtype={args.dtype} V={VOCAB} centroids={CENTROIDS} top_k={TOP_K}")
    print(f"{'T':>4} {'ours us':>10} {'reference':>12} {'in-tree':>12} {'full-vocab':>12}")
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(t, HIDDEN, generator=gen).to(device, dtype)
        ours = _time(
            lambda h=hidden: centroid_argmax(h, lm_head, mask),
            device,
            args.reps,
        )
        ref = _time(
            lambda h=hidden: centroid_argmax_reference(h, lm_head, mask),
            device,
            max(3, args.reps // 4),
        )
        tree = (
            _time(lambda h=hidden: embedder.get_top_tokens(h, lm_head), device, args.reps)
            if embedder is not None
            else float("nan")
        )
        full = _time(lambda h=hidden: (h @ lm_head.t()).argmax(-1), device, args.reps)
        print(
            f"{t:>4} {ours:>10.1f} {ref / ours:>11.2f}x {tree / ours:>11.2f}x {full / ours:>11.2f}x"
        )
    print("ratios are each method's median time / ours (> 1: ours is faster)")


if __name__ == "__main__":
    main()
