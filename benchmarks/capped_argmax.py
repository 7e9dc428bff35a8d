"""The greedy tokens of a verification step's soft-capped logits: our one-read kernel
(``ops/capped_argmax``) against vLLM's path, side by side, at Gemma 4's vocabulary.

    PYTHONPATH=$PWD python3 benchmarks/capped_argmax.py [--rows 1,8,32,96,128,256]
        [--reps 200] [--dtype bfloat16] [--json out.json] [--smoke]

Needs only torch and triton. Each variant is captured in a CUDA graph and timed by
``centroid_argmax.py``'s harness (cold L2 before every replay, the median of ``--reps``); on
CPU it only checks that everything runs (``--smoke``: small sizes, for the interpreter).

Variants, from the logits ``[rows, V]`` the lm_head wrote:
* ``ours``: ``capped_argmax(raw, 30.0)`` (the soft-cap in registers, one read);
* ``vllm``: what V2 does with them for an all-greedy batch, which is the reference: the
  ``LogitsProcessor``'s soft-cap (``/ cap``, ``tanh``, ``* cap``, three passes) and the argmax
  our greedy verification takes of the capped logits (``torch.argmax``);
* ``argmax``: ``torch.argmax`` of the logits alone (the last of ``vllm``'s four passes);
* ``floor``: a graph of one trivial kernel (the harness's own floor).

Columns: median us; ``vllm/ours``: how many times faster ours is; ``HBM us``: the logits read
once at ``COPY_BANDWIDTH``; ``equal``: ours' tokens equal to the reference's (must be 1).

``--sweep``: instead, our kernel at other sizes (``SWEEP``: programs an SM, values a tile,
warps, tiles loaded an iteration), each row's defaults and its fastest, every variant's
tokens checked against the reference (a ``!`` marks one that differs), then the variants by
mean time over each row's best. On CUDA only.
"""

from __future__ import annotations

import argparse
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
    relative_scores,
    write_rows,
)

from gemma4_spec.ops.capped_argmax import (  # noqa: E402
    capped_argmax,
    capped_argmax_reference,
    kernel_applies,
)
from gemma4_spec.ops.capped_argmax_triton import (  # noqa: E402
    BLOCK,
    NUM_WARPS,
    PROGRAMS_PER_SM,
    TILES,
    capped_argmax_kernel,
)

VOCAB = 262144
SMOKE_VOCAB = 3000
SOFT_CAP = 30.0  # Gemma 4's final_logit_softcapping
COPY_BANDWIDTH = 4.26e12  # bytes/s, H200 (docs/gpu.md)
VARIANTS = ("ours", "vllm", "argmax", "floor")
# --sweep: (programs an SM, values a tile, warps, tiles loaded an iteration); the first is
# the kernel's default.
DEFAULT_SIZES = (PROGRAMS_PER_SM, BLOCK, NUM_WARPS, TILES)
SWEEP = [DEFAULT_SIZES] + [
    (p, b, w, t)
    for p in (4, 8, 16)
    for b in (1024, 2048, 4096, 8192)
    for w in (4, 8)
    for t in (1, 2)
    if (p, b, w, t) != DEFAULT_SIZES and b * t <= 8192
]


def sweep(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, reps: int) -> None:
    """Our kernel at each of ``SWEEP``'s sizes, row count by row count (module docstring)."""
    flush = torch.zeros(64 * 2**20, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (int(x) for x in args.rows.split(",")):
        logits = (torch.randn(n, VOCAB, generator=gen) * 12).to(device, dtype)
        want = capped_argmax_reference(logits, SOFT_CAP)
        times = {}
        for sizes in SWEEP:
            label = "p{}/b{}/w{}/t{}".format(*sizes)
            if not torch.equal(capped_argmax_kernel(logits, SOFT_CAP, *sizes), want):
                label += "!"
            times[label] = _time_cuda(
                lambda x=logits, z=sizes: capped_argmax_kernel(x, SOFT_CAP, *z), reps, flush
            )
        first, best = next(iter(times)), min(times, key=times.__getitem__)
        print(f"{n:>5}  defaults {first} {times[first]:7.1f}  best {best} {times[best]:7.1f}")
        rows.append({"rows": n, "us": times})
    score = relative_scores([row["us"] for row in rows])
    print("\nvariants by mean time over each row's best (1.00 = best everywhere)")
    for label in sorted(score, key=score.__getitem__)[:8]:
        print(f"  {label:16s} {score[label]:.3f}")
    if args.json:
        write_rows(args.json, {"device": str(device), "dtype": args.dtype, "sweep": True}, rows)


def main() -> None:
    parser = kernel_bench_parser(__doc__, "--rows", "1,4,8,16,32,64,96,128,192,256")
    parser.add_argument("--sweep", action="store_true", help="our kernel at other sizes")
    args = parser.parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    if args.sweep:
        if not cuda:
            raise SystemExit("--sweep times the kernel on CUDA only")
        sweep(args, device, dtype, reps)
        return
    vocab = SMOKE_VOCAB if args.smoke else VOCAB
    flush = torch.zeros(64 * 2**20, dtype=torch.float32, device=device) if cuda else None
    gen = torch.Generator().manual_seed(0)
    print(f"device={device} dtype={args.dtype} V={vocab} reps={reps}")
    probe = torch.zeros(1, vocab, dtype=dtype, device=device)
    if not kernel_applies(probe, SOFT_CAP):
        print("(the kernel does not apply here: 'ours' runs the reference)")
    print(
        f"{'rows':>5} {'ours':>8} {'vllm':>8} {'argmax':>8} {'floor':>6} "
        f"{'vllm/ours':>9} {'HBM us':>7} {'equal':>5}"
    )
    rows = []
    for n in (int(x) for x in args.rows.split(",")):
        # Logits of a random lm_head's size: many above the cap, so its ties decide tokens.
        logits = (torch.randn(n, vocab, generator=gen) * 12).to(device, dtype)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "ours": lambda x=logits: capped_argmax(x, SOFT_CAP),
            "vllm": lambda x=logits: capped_argmax_reference(x, SOFT_CAP),
            "argmax": lambda x=logits: x.argmax(dim=-1),
        }
        if cuda:
            tiny = torch.zeros(1, device=device)
            fns["floor"] = lambda x=tiny: x.add_(1)
        us = {
            name: (_time_cuda(fn, reps, flush) if cuda else _time_cpu(fn, reps))
            for name, fn in fns.items()
        }
        equal = capped_argmax(logits, SOFT_CAP) == capped_argmax_reference(logits, SOFT_CAP)
        row = {
            "rows": n,
            **{f"{name}_us": us.get(name) for name in VARIANTS},
            "vllm_over_ours": us["vllm"] / us["ours"],
            "hbm_floor_us": n * vocab * logits.element_size() / COPY_BANDWIDTH * 1e6,
            "equal": equal.float().mean().item(),
        }
        rows.append(row)
        floor = f"{us['floor']:>6.1f}" if "floor" in us else f"{'-':>6}"
        print(
            f"{n:>5} {us['ours']:>8.1f} {us['vllm']:>8.1f} {us['argmax']:>8.1f} {floor} "
            f"{row['vllm_over_ours']:>8.2f}x {row['hbm_floor_us']:>7.1f} {row['equal']:>5.2f}"
        )
    if args.json:
        meta = {"device": str(device), "dtype": args.dtype, "vocab": vocab, "reps": reps}
        write_rows(args.json, meta, rows)


if __name__ == "__main__":
    main()
