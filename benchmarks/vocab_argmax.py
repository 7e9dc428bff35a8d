"""Greedy drafting over the full vocabulary (the 26B-A4B / 31B assistants: no centroids,
H=1024, V=262144): our kernel vs its torch reference vs vLLM's in-tree formula, side by side.

    PYTHONPATH=$PWD python3 benchmarks/vocab_argmax.py [--tokens 1,2,4,8,16,32,64,128,256]
        [--reps 200] [--dtype bfloat16] [--json out.json] [--smoke]

Needs only torch and triton. On CUDA every variant is captured in a CUDA graph; before each
replay a 256 MiB buffer is written (cold L2, outside the timed region) and CUDA events time the
replay alone; the median of ``--reps`` replays is reported (``centroid_argmax.py``'s harness).
On CPU (no graphs, few reps) it only checks that everything runs: ``--smoke`` shrinks the sizes
so that the kernel runs under ``TRITON_INTERPRET=1``.

Variants:
* ``ours``: ``vocab_argmax`` (one launch, no [T, V] tensor); ``ours-supp``: the same with
  ``SUPPRESSED`` random suppressed tokens (what their mask costs);
* ``reference``: ``vocab_argmax_reference`` (float32 logits, the definition);
* ``in-tree``: what vLLM's Gemma 4 MTP model does for a greedy draft without centroids:
  ``lm_head(h)`` in the model dtype, soft-cap (``/ cap``, ``tanh``, ``* cap``, cap 30 as in
  Gemma 4), ``argmax``;
* ``matmul``: ``h @ lm_head^T`` alone (the in-tree formula's first kernel);
* ``floor``: a graph of one trivial kernel (the harness's own floor).

Columns: median us per variant; ``in-tree/ours`` and ``ref/ours``: how many times faster ours
is; ``HBM us``: the lm_head and hidden states read once at ``COPY_BANDWIDTH`` (the H200's
measured copy bandwidth, ``docs/gpu.md``); ``GB/s`` and ``TFLOP/s`` of ours; ``ok``: the
fraction of ours' (and in-tree's) tokens equal to the float32 reference's (bf16 near-ties may
differ; in-tree rounds its logits to bf16 before the argmax, so it ties and differs more).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import (  # noqa: E402
    _time_cpu,
    _time_cuda,
    bench_setup,
    kernel_bench_parser,
    write_rows,
)

from gemma4_spec.ops.vocab_argmax import vocab_argmax_reference  # noqa: E402
from gemma4_spec.ops.vocab_argmax_triton import (  # noqa: E402
    triton_usable,
    vocab_argmax,
    vocab_argmax_config,
)

REAL = (262144, 1024)  # vocab, hidden: the 26B-A4B and 31B assistants
SMOKE = (1000, 64)
SOFT_CAP = 30.0  # Gemma 4's final_logit_softcapping
SUPPRESSED = 16
COPY_BANDWIDTH = 4.26e12  # bytes/s, H200 (docs/gpu.md)
VARIANTS = ("ours", "ours-supp", "reference", "in-tree", "matmul", "floor")


def in_tree_formula(hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """vLLM's greedy draft without centroids: logits in the model dtype (its LogitsProcessor
    over the lm_head, with the soft-cap as three element-wise passes), then argmax."""
    logits = hidden @ lm_head.t()
    logits = logits / SOFT_CAP
    logits = torch.tanh(logits)
    logits = logits * SOFT_CAP
    return logits.argmax(dim=-1)


def _cell(us: dict[str, float], name: str, width: int) -> str:
    return f"{us[name]:>{width}.1f}" if name in us else f"{'-':>{width}}"


def main() -> None:
    args = kernel_bench_parser(__doc__, "--tokens", "1,2,4,8,16,32,64,128,256").parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    vocab, hidden_size = SMOKE if args.smoke else REAL
    es = torch.tensor([], dtype=dtype).element_size()

    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, hidden_size, generator=gen).to(device, dtype)
    suppressed = torch.randperm(vocab, generator=gen)[:SUPPRESSED].to(device)
    flush = torch.zeros(64 * 2**20, dtype=torch.float32, device=device) if cuda else None
    if not triton_usable(device):
        print("(no Triton on this device: 'ours' is the reference)")
    print(f"device={device} dtype={args.dtype} V={vocab} H={hidden_size} reps={reps}")
    head = (
        f"{'T':>4} {'ours':>8} {'ours-supp':>9} {'reference':>9} {'in-tree':>8} "
        f"{'matmul':>8} {'floor':>6} {'in-tree/ours':>12} {'ref/ours':>8} {'HBM us':>7} "
        f"{'GB/s':>6} {'TFLOP/s':>7} {'ok':>4} {'ok in-tree':>10}  config"
    )
    print(head)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(t, hidden_size, generator=gen).to(device, dtype)
        want = vocab_argmax_reference(hidden, lm_head)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "ours": lambda h=hidden: vocab_argmax(h, lm_head),
            "ours-supp": lambda h=hidden: vocab_argmax(h, lm_head, suppressed),
            "reference": lambda h=hidden: vocab_argmax_reference(h, lm_head),
            "in-tree": lambda h=hidden: in_tree_formula(h, lm_head),
            "matmul": lambda h=hidden: h @ lm_head.t(),
        }
        if cuda:
            tiny = torch.zeros(1, device=device)
            fns["floor"] = lambda x=tiny: x.add_(1)
        us: dict[str, float] = {}
        for name, fn in fns.items():
            try:
                us[name] = _time_cuda(fn, reps, flush) if cuda else _time_cpu(fn, reps)
            except Exception as exc:  # e.g. a variant that cannot be captured
                print(f"{t:>4} {name} failed: {type(exc).__name__}: {exc}"[:200])
        nbytes = (vocab + t) * hidden_size * es
        ours_us = us.get("ours", float("nan"))
        agree = (vocab_argmax(hidden, lm_head) == want).float().mean().item()
        agree_in_tree = (in_tree_formula(hidden, lm_head) == want).float().mean().item()
        cfg = vocab_argmax_config(t, vocab, hidden_size, device) if triton_usable(device) else None
        row = {
            "tokens": t,
            **{f"{name.replace('-', '_')}_us": us.get(name) for name in VARIANTS},
            "in_tree_over_ours": us.get("in-tree", float("nan")) / ours_us,
            "reference_over_ours": us.get("reference", float("nan")) / ours_us,
            "hbm_floor_us": nbytes / COPY_BANDWIDTH * 1e6,
            "ours_gb_per_s": nbytes / (ours_us * 1e-6) / 1e9,
            "ours_tflop_per_s": 2 * t * vocab * hidden_size / (ours_us * 1e-6) / 1e12,
            "agree_with_fp32_reference": agree,
            "in_tree_agree_with_fp32_reference": agree_in_tree,
            "config": cfg._asdict() if cfg is not None else None,
        }
        rows.append(row)

        print(
            f"{t:>4} {_cell(us, 'ours', 8)} {_cell(us, 'ours-supp', 9)} "
            f"{_cell(us, 'reference', 9)} {_cell(us, 'in-tree', 8)} {_cell(us, 'matmul', 8)} "
            f"{_cell(us, 'floor', 6)} "
            f"{row['in_tree_over_ours']:>11.2f}x {row['reference_over_ours']:>7.2f}x "
            f"{row['hbm_floor_us']:>7.1f} {row['ours_gb_per_s']:>6.0f} "
            f"{row['ours_tflop_per_s']:>7.1f} {agree:>4.2f} {agree_in_tree:>10.2f}  "
            f"{tuple(cfg) if cfg is not None else '-'}"
        )
    print("us: median per call; x: times faster than ours' time; ok: equal to fp32 reference")
    if args.json:
        meta = {
            "device": str(device),
            "dtype": args.dtype,
            "vocab": vocab,
            "hidden": hidden_size,
            "reps": reps,
            "soft_cap": SOFT_CAP,
            "suppressed": SUPPRESSED,
        }
        write_rows(args.json, meta, rows)


if __name__ == "__main__":
    main()
