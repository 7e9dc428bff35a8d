"""The draft attention's query norm and rotary embedding at draft-step row counts: our fused
kernel (``ops/q_norm_rope*.py``) vs what the compiled draft runs for them (vLLM's formula under
torch.compile: Inductor's reduction and pointwise kernels) vs the float32 reference, side by side.

    PYTHONPATH=$PWD python3 benchmarks/q_norm_rope.py [--tokens 1,8,16,32,64] [--reps 200]
        [--json out.json] [--smoke]

Needs only torch and triton. On CUDA every variant is captured in a CUDA graph and timed by
``centroid_argmax.py``'s harness two ways: alone (cold L2 before each replay, the median of
``--reps``), and as ``CHAIN`` calls back to back in one graph (``chain``: us a call, as a draft
step's layers run it, without a graph launch of its own). On CPU it only checks that everything
runs (``--smoke``: small heads, for ``TRITON_INTERPRET=1``).

Shapes: the E2B assistant's query, 8 heads of 256 (sliding layers) or 512 (the full layer),
every value rotated (Gemma 4's proportional rotary embedding has ``rotary_dim = head_dim``).
``ok``: ours within two roundings of the reference (``testing/closeness.py``, the tests' rule).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import (  # noqa: E402
    _time_cpu,
    _time_cuda,
    _time_cuda_chain,
    bench_setup,
    kernel_bench_parser,
)

from gemma4_spec.ops.centroid_argmax_triton import triton_usable  # noqa: E402
from gemma4_spec.ops.q_norm_rope import q_norm_rope, q_norm_rope_reference  # noqa: E402
from gemma4_spec.testing.closeness import per_head_excess  # noqa: E402

# name: (heads, head_dim)
SHAPES = {"sliding": (8, 256), "full": (8, 512)}
SMOKE_SHAPES = {"small": (2, 16)}
VARIANTS = ("ours", "compiled formula", "reference")
CHAIN = 8  # calls a draft step makes (4 layers, k = 2)
EPS = 1e-6
MAX_POSITION = 4096


def rotary_cache(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[MAX_POSITION, cos | sin]`` rotating every value of a head, base 1e4."""
    freqs = 1e4 ** (-torch.arange(head_dim // 2) / head_dim)
    angles = torch.outer(torch.arange(float(MAX_POSITION)), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device, dtype)


def vllm_formula(
    q: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor,
    pos: torch.Tensor,
    eps: float,
    head_dim: int,
) -> torch.Tensor:
    """vLLM's RMSNorm and neox rotary embedding as their native forwards write them (the
    norm rounded before its weight, the rotation in the query's dtype)."""
    rows = q.shape[0]
    x = q.view(rows, -1, head_dim).float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(q.dtype) * weight
    cos, sin = cache.index_select(0, pos).unsqueeze(1).chunk(2, dim=-1)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], -1).view(rows, -1)


def _variants(
    q: torch.Tensor,
    weight: torch.Tensor,
    cache: torch.Tensor,
    pos: torch.Tensor,
    head_dim: int,
    compiled: Callable[..., torch.Tensor],
) -> dict[str, Callable[[], torch.Tensor]]:
    return {
        "ours": lambda: q_norm_rope(q, weight, cache, pos, EPS, head_dim),
        "compiled formula": lambda: compiled(q, weight, cache, pos, EPS, head_dim),
        "reference": lambda: q_norm_rope_reference(q, weight, cache, pos, EPS, head_dim),
    }


def main() -> None:
    parser = kernel_bench_parser(__doc__.splitlines()[0], "--tokens", "1,8,16,32,64", cpu_reps=2)
    args = parser.parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    if not triton_usable(device):
        sys.exit("needs CUDA and triton, or TRITON_INTERPRET=1 on CPU")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    flush = torch.empty(64 << 20 if cuda else 1, dtype=torch.float32, device=device)
    compiled = torch.compile(vllm_formula, dynamic=True) if cuda else vllm_formula
    gen = torch.Generator().manual_seed(0)
    rows_out: list[dict] = []
    print(f"{'shape':8s} {'T':>3s} " + " ".join(f"{v:>16s}" for v in VARIANTS)
          + f" {'chain ours':>11s} {'chain compiled':>14s} {'ok':>3s}")  # fmt: skip
    for name, (heads, head_dim) in shapes.items():
        weight = (1 + torch.rand(head_dim, generator=gen)).to(device, dtype)
        cache = rotary_cache(head_dim, device, dtype)
        for t in [int(x) for x in args.tokens.split(",")]:
            q = torch.randn(t, heads * head_dim, generator=gen).to(device, dtype)
            pos = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(device)
            fns = _variants(q, weight, cache, pos, head_dim, compiled)
            timed = (lambda fn: _time_cuda(fn, reps, flush)) if cuda else (
                lambda fn: _time_cpu(fn, reps)
            )  # fmt: skip
            us = {v: timed(fns[v]) for v in VARIANTS}
            chain = {
                v: _time_cuda_chain([fns[v]] * CHAIN, reps) if cuda else float("nan")
                for v in ("ours", "compiled formula")
            }
            ok = per_head_excess(fns["ours"](), fns["reference"](), head_dim) <= 0
            print(f"{name:8s} {t:3d} " + " ".join(f"{us[v]:16.2f}" for v in VARIANTS)
                  + f" {chain['ours']:11.2f} {chain['compiled formula']:14.2f}"
                  f" {'yes' if ok else 'NO':>3s}")  # fmt: skip
            rows_out.append({"shape": name, "heads": heads, "head_dim": head_dim, "tokens": t,
                             "us": us, "chain_us": chain, "ok": ok})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
