"""Where one engine's GPU time per output token differs from another's, kernel by kernel.

Reads two files written by ``profile_decode.py --kernels-json`` (same pair, batch size and
acceptance) and prints the GPU time per output token of each engine by family of kernel
(matmuls, attention, Inductor's fused kernels, ours, copies), then the kernels whose time
differs most. For finding what a speculative step adds to a plain one, not for figures.

    python benchmarks/kernel_diff.py plain-b8.json ours-V2-b8.json [--rows 25]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# (family, pattern on the kernel name), first match wins.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("matmul (ours)", r"^_small_linear"),
    ("draft argmax (ours)", r"^_(centroid|vocab_argmax|persistent|scores_dot|select_rank)"),
    ("verification and staging (ours)", r"^_(verify|stage|draft_rows|next_tokens)"),
    ("matmul (cuBLAS)", r"nvjet|gemm|splitKreduce|cutlass|xmma"),
    ("attention", r"unified_attention|reduce_segments|attn"),
    ("Inductor fused", r"^triton_"),
    ("copies and fills", r"[Mm]emcpy|[Mm]emset|copy|fill|elementwise"),
    ("reductions and sampling", r"reduce|argmax|topk|sort|gumbel|sample"),
)


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name):
            return label
    return "other"


def load(path: str) -> dict[str, tuple[float, float]]:
    record = json.loads(Path(path).read_text())
    return {name: (float(n), float(us)) for name, (n, us) in record["kernels"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="kernels JSON of the reference engine (e.g. plain)")
    parser.add_argument("other", help="kernels JSON of the engine compared with it")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    base, other = load(args.base), load(args.other)
    names = sorted(set(base) | set(other))
    zero = (0.0, 0.0)

    print(f"GPU us per output token: {args.base} -> {args.other}")
    by_family: dict[str, list[float]] = {}
    for name in names:
        row = by_family.setdefault(family(name), [0.0, 0.0, 0.0, 0.0])
        for i, (n, us) in enumerate((base.get(name, zero), other.get(name, zero))):
            row[2 * i] += n
            row[2 * i + 1] += us
    print(f"{'family':34s} {'launches':>17s} {'us':>21s} {'difference':>10s}")
    for label, (n0, us0, n1, us1) in sorted(by_family.items(), key=lambda kv: kv[1][1] - kv[1][3]):
        print(f"{label:34s} {n0:7.1f} -> {n1:7.1f} {us0:9.1f} -> {us1:9.1f} {us1 - us0:+10.1f}")
    total0 = sum(us for _, us in base.values())
    total1 = sum(us for _, us in other.values())
    print(f"{'all':34s} {'':17s} {total0:9.1f} -> {total1:9.1f} {total1 - total0:+10.1f}")

    print("\nkernels that differ most (us per output token; launches in brackets):")
    ranked = sorted(names, key=lambda n: -abs(other.get(n, zero)[1] - base.get(n, zero)[1]))
    for name in ranked[: args.rows]:
        (n0, us0), (n1, us1) = base.get(name, zero), other.get(name, zero)
        print(f"  {us1 - us0:+9.1f}  {us0:8.1f} ({n0:5.1f}) -> {us1:8.1f} ({n1:5.1f})  {name[:90]}")


if __name__ == "__main__":
    main()
