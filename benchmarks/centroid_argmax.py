"""Greedy draft sampling at real Gemma 4 assistant dimensions (V=262144, 2048 centroids,
top-k 32, d=256): the fused Triton kernels (dispatcher and each path) vs the torch sparse path
vs vLLM's in-tree formula vs a full-vocab argmax, side by side in one run.

    .venv/bin/python benchmarks/centroid_argmax.py [--tokens 1,2,3,4,8,16,32,64,256] [--reps 200]
        [--dtype bfloat16] [--json out.json] [--smoke]

On CUDA every variant is captured in a CUDA graph; before each replay a 256 MiB buffer is
written (cold L2, outside the timed region) and CUDA events time the replay alone; the median
of ``--reps`` replays is reported. On CPU (no graphs, few reps; ``--smoke`` shrinks the sizes)
it only checks that everything runs. "bytes" is each variant's minimal traffic model (below),
"GB/s" that model divided by the median time. "P" is the persistent kernel's programs per
token at that T (``persistent_programs``: sized by the compiled kernel's occupancy; "-" where
the variant does not run it, 0 where the persistent path falls back to the centroid path).

Minimal bytes: persistent = centroid weights + T x (top_k x V/C lm_head rows + their int32
ids); centroid (the centroid-major path) = centroid weights + the rows (and int32 ids) of the
union of all tokens' picked centroids; full-vocab = the whole lm_head + centroid weights;
in-tree and torch-sparse = their floor, the same as persistent (they also write and re-read the
gathered rows, which the model does not count); ours-scores and ours-select = the centroid
weights.

Variants: ours-auto (the dispatcher), ours-persistent, ours-centroid (each path forced;
persistent runs the centroid path where not even PERSISTENT_MIN_PROGRAMS programs per
token fit the GPU at once); to see where their time goes:
ours-3launch (the persistent kernel as three launches, one per phase, no grid barriers),
ours-scores (the centroid path's first kernel alone), ours-select (its first two: scores and
rank top-k; the third kernel is ours-centroid minus this); then torch-sparse, in-tree,
full-vocab, graph-floor (a graph of one trivial kernel: the harness's own floor).
``--variants a,b`` times only those.

``--zero-rows N``: the last N rows of each batch of more than N tokens are zeros, as the
padding rows of a draft step's CUDA graph can be (a row with no keys to attend to): every
centroid score of such a row ties, which the rank top-k must bound like any other row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from gemma4_spec.ops.centroid_argmax import CentroidMask, centroid_argmax
from gemma4_spec.ops.centroid_argmax_triton import (
    CENTROID_MIN_TOKENS,
    _state_for,
    centroid_argmax_fp32_reference,
    centroid_argmax_fused,
    centroid_argmax_persistent,
    centroid_scores,
    persistent_programs,
    select_centroids_ranked,
    triton_usable,
)

REAL = (262144, 2048, 32, 256)  # vocab, centroids, top_k, hidden: E2B / E4B assistants
SMOKE = (8192, 64, 8, 64)


def in_tree_formula(vocab: int, centroids: int, top_k: int, d: int):  # type: ignore[no-untyped-def]
    """vLLM's own masked embedder when importable (its get_top_tokens), else None."""
    try:
        from vllm.model_executor.models.gemma4_mtp import Gemma4MTPMaskedEmbedder
    except Exception:
        return None
    return Gemma4MTPMaskedEmbedder(d, vocab, centroids, top_k)


def in_tree_restated(hidden: torch.Tensor, lm_head: torch.Tensor, mask: CentroidMask):
    """The in-tree maths in plain torch: centroid matmul, top-k, gather [T, k*V/C, d], bmm,
    scatter into full-vocab -inf logits, argmax."""
    chosen = torch.topk(hidden @ mask.centroids_weight.t(), k=mask.top_k, dim=-1).indices
    ids = mask.token_ordering.view(mask.centroids_weight.shape[0], -1)[chosen].flatten(1)
    rows = lm_head[ids]  # [T, S, d]
    scores = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
    logits = hidden.new_full((hidden.shape[0], lm_head.shape[0]), torch.finfo(hidden.dtype).min)
    logits.scatter_(1, ids, scores)
    return logits.argmax(dim=-1)


def _captured(fns: list[Callable[[], torch.Tensor]], warmups: int) -> torch.cuda.CUDAGraph:
    """``fns`` run ``warmups`` times on a side stream (compilations, allocations), then captured
    back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def _replays_us(graph: torch.cuda.CUDAGraph, reps: int, flush: torch.Tensor | None = None) -> float:
    """The median of ``reps`` replays of ``graph`` in us, CUDA events around each replay alone
    (``flush`` written before each, untimed: a cold L2)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.add_(1)  # evicts L2; not timed
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3


def _time_cuda(fn: Callable[[], torch.Tensor], reps: int, flush: torch.Tensor) -> float:
    return _replays_us(_captured([fn], warmups=3), reps, flush)


def _time_cuda_chain(fns: list[Callable[[], torch.Tensor]], reps: int) -> float:
    """us a call of ``fns`` captured back to back in one CUDA graph (median replay over
    ``len(fns)``), L2 left as the chain leaves it: as a kernel runs among a model's layers, each
    call on its own layer's tensors, without a graph launch of its own to pay for."""
    graph = _captured(fns, warmups=1)
    graph.replay()
    return _replays_us(graph, reps) / len(fns)


def relative_scores(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each variant's mean, over ``rows`` (variant -> time, one dict a shape), of its time over
    that row's fastest (1.00: the best everywhere); variants missing from a row are left out."""
    return {
        label: sum(row[label] / min(row.values()) for row in rows) / len(rows)
        for label in rows[0]
        if all(label in row for row in rows)
    }


def _time_cpu(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def kernel_bench_parser(
    description: str, sizes: str, default_sizes: str, cpu_reps: int = 3
) -> argparse.ArgumentParser:
    """The kernel benchmarks' common arguments: ``--device``, ``--dtype``, the sizes to time
    (``sizes``, e.g. ``--tokens``), ``--reps`` (200 on CUDA, ``cpu_reps`` on CPU), ``--smoke``
    and ``--json``; each adds its own after."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument(sizes, default=default_sizes)
    parser.add_argument(
        "--reps", type=int, default=None, help=f"default 200 on CUDA, {cpu_reps} on CPU"
    )
    parser.add_argument("--smoke", action="store_true", help="small sizes (CPU smoke test)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.set_defaults(cpu_reps=cpu_reps)
    return parser


def bench_setup(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, bool, int]:
    """(device, dtype, whether it is CUDA, repetitions) from ``kernel_bench_parser``'s args."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    return device, dtype, cuda, args.reps or (200 if cuda else args.cpu_reps)


def write_rows(path: str, meta: dict, rows: list) -> None:
    """A kernel benchmark's JSON file: its settings (and the GPU's name) and its rows."""
    if torch.cuda.is_available() and meta.get("device", "").startswith("cuda"):
        meta = {**meta, "gpu": torch.cuda.get_device_name()}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main() -> None:
    parser = kernel_bench_parser(__doc__, "--tokens", "1,2,3,4,8,16,32,64,256")
    parser.add_argument("--variants", default=None, help="comma-separated names (default all)")
    parser.add_argument("--zero-rows", type=int, default=0, help="zero rows ending each batch")
    args = parser.parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    vocab, centroids, top_k, d = SMOKE if args.smoke else REAL
    tpc, es = vocab // centroids, torch.tensor([], dtype=dtype).element_size()

    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, d, generator=gen).to(device, dtype)
    centroid_w = torch.randn(centroids, d, generator=gen).to(device, dtype)
    ordering = torch.randperm(vocab, generator=gen).to(device)
    mask = CentroidMask(centroid_w, ordering, top_k)
    flush = torch.zeros(64 * 2**20, dtype=torch.float32, device=device) if cuda else None

    embedder = in_tree_formula(vocab, centroids, top_k, d)
    if embedder is not None:
        embedder = embedder.to(device, dtype)
        embedder.centroids.weight.data.copy_(centroid_w)
        embedder.token_ordering.copy_(ordering)
        print("in-tree: vLLM's Gemma4MTPMaskedEmbedder.get_top_tokens")
    else:
        print("in-tree: vLLM not importable, its maths restated in torch (in_tree_restated)")
    fused = triton_usable(device)
    if not fused:
        print("(no Triton on this device: 'ours' falls back to the torch sparse path)")

    head_bytes = vocab * d * es + centroids * d * es

    def per_token_bytes(t: int) -> int:
        return centroids * d * es + t * (top_k * tpc * (d * es + 4) + d * es)

    def centroid_bytes(h: torch.Tensor) -> int:
        """Centroid weights + the union of all tokens' picked centroids' rows (and their int32
        ids) + the hidden states."""
        picks = (h.float() @ centroid_w.float().t()).topk(top_k, dim=-1).indices
        union = int(picks.unique().numel())
        return centroids * d * es + union * tpc * (d * es + 4) + h.numel() * es

    print(
        f"device={device} dtype={args.dtype} V={vocab} C={centroids} top_k={top_k} d={d} "
        f"reps={reps} centroid_min_tokens={CENTROID_MIN_TOKENS} zero_rows={args.zero_rows}"
    )
    print(f"{'T':>4} {'variant':<15} {'P':>4} {'median us':>10} {'MB':>8} {'GB/s':>8} {'ok':>4}")
    rows = []
    state = _state_for(mask, vocab) if fused else None
    cw = mask.centroids_weight
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(t, d, generator=gen).to(device, dtype)
        zero_rows = args.zero_rows if t > args.zero_rows else 0
        if zero_rows:
            hidden[t - zero_rows :] = 0
        want = centroid_argmax_fp32_reference(hidden, lm_head, mask)
        progs = persistent_programs(mask, hidden, lm_head) if fused else 0
        small = fused and t < CENTROID_MIN_TOKENS and progs > 0
        persistent_bytes = per_token_bytes(t) if progs > 0 else centroid_bytes(hidden)
        # programs per token of the variants that run the persistent kernel
        runs_persistent = {"ours-persistent": progs, "ours-3launch": progs}
        if small:
            runs_persistent["ours-auto"] = progs
        auto_bytes = per_token_bytes(t) if small else centroid_bytes(hidden)
        variants: list[tuple[str, Callable[[], torch.Tensor], int]] = [
            ("ours-auto", lambda h=hidden: centroid_argmax_fused(mask, h, lm_head), auto_bytes),
            (
                "ours-persistent",
                lambda h=hidden: centroid_argmax_fused(mask, h, lm_head, path="persistent"),
                persistent_bytes,
            ),
            (
                "ours-centroid",
                lambda h=hidden: centroid_argmax_fused(mask, h, lm_head, path="centroid"),
                centroid_bytes(hidden),
            ),
            (
                "torch-sparse",
                lambda h=hidden: centroid_argmax(h, lm_head, mask),
                per_token_bytes(t),
            ),
            (
                "in-tree",
                (lambda h=hidden: embedder.get_top_tokens(h, lm_head))
                if embedder is not None
                else (lambda h=hidden: in_tree_restated(h, lm_head, mask)),
                per_token_bytes(t),
            ),
            ("full-vocab", lambda h=hidden: (h @ lm_head.t()).argmax(-1), head_bytes),
        ]
        if cuda:  # what the harness measures for a graph of one trivial kernel
            tiny = torch.zeros(1, device=device)
            variants.append(("graph-floor", lambda x=tiny: x.add_(1), 0))
        if fused:  # where the time of each path goes
            variants[3:3] = [
                (  # the persistent kernel as three launches, one per phase: no grid barriers
                    "ours-3launch",
                    lambda h=hidden: centroid_argmax_persistent(mask, h, lm_head, phased=True),
                    persistent_bytes,
                ),
                (  # the centroid path's first kernel alone
                    "ours-scores",
                    lambda h=hidden: centroid_scores(state, h, cw)[0],
                    centroids * d * es,
                ),
                (  # its first two kernels: scores, then the rank top-k
                    "ours-select",
                    lambda h=hidden: select_centroids_ranked(state, h, cw)[0],
                    centroids * d * es,
                ),
            ]
        if args.variants:
            wanted = set(args.variants.split(","))
            variants = [v for v in variants if v[0] in wanted]
        for name, fn, nbytes in variants:
            try:
                us = _time_cuda(fn, reps, flush) if cuda else _time_cpu(fn, reps)
            except Exception as exc:  # e.g. a variant that cannot be captured
                print(f"{t:>4} {name:<15} failed: {type(exc).__name__}: {exc}"[:200])
                continue
            no_check = name in ("ours-scores", "ours-select", "graph-floor")
            agree = float("nan") if no_check else (fn() == want).float().mean().item()
            gbps = nbytes / (us * 1e-6) / 1e9
            p = runs_persistent.get(name)
            print(
                f"{t:>4} {name:<15} {'-' if p is None else p:>4} {us:>10.1f} "
                f"{nbytes / 1e6:>8.1f} {gbps:>8.0f} {agree:>4.2f}"
            )
            rows.append(
                {
                    "tokens": t,
                    "zero_rows": zero_rows,
                    "variant": name,
                    "programs_per_token": p,
                    "median_us": us,
                    "bytes": nbytes,
                    "gb_per_s": gbps,
                    "agree_with_fp32_reference": agree,
                }
            )
    print(
        "ok = fraction of tokens equal to the fp32 reference (bf16 near-ties may differ, and"
        " a zero row's ties on the torch and in-tree paths, whose top-k breaks ties freely)"
    )
    if args.json:
        meta = {"device": str(device), "dtype": args.dtype, "vocab": vocab, "reps": reps}
        write_rows(args.json, meta, rows)


if __name__ == "__main__":
    main()
