"""The assistant's matmuls at draft-step row counts: our kernel vs its torch reference vs what
vLLM runs for them (``F.linear``: cuBLAS), side by side, per shape and for a whole draft step.

    PYTHONPATH=$PWD python3 benchmarks/small_linear.py [--tokens 1,2,4,8,16,32,64]
        [--reps 200] [--dtype bfloat16] [--sweep] [--json out.json] [--smoke]

Needs only torch and triton. On CUDA every variant is captured in a CUDA graph and timed by
``centroid_argmax.py``'s harness (cold L2 before each replay, CUDA events, the median of
``--reps`` replays). On CPU it only checks that everything runs (``--smoke``: small shapes, for
``TRITON_INTERPRET=1``).

Shapes (``N x K``, from the published E2B assistant: hidden 256, 8 heads of 256 (sliding) or
512 (full attention), MLP 2048, backbone 1536) and how many of each one draft step runs
(``PER_STEP``). Columns: median us of ``ours`` (``small_linear``), ``cuBLAS`` (``F.linear``)
and ``reference`` (float32 matmul); ``cuBLAS/ours``; ``splits`` of ours' launch; ``ok``: ours
within one rounding of the reference (``testing/closeness.py``, the tests' rule). The ``step``
row sums each variant over a draft step's 18 matmuls. The ``gated`` rows time the MLP's gate/up
matmul with its activation: ours in one launch (``small_linear_gelu_and_mul``), ours then the
activation kernel, cuBLAS then the activation kernel (vLLM's ``gelu_tanh_and_mul`` where
installed; under torch.compile the engine runs Inductor's kernel of the same formula, one launch
as well), and the reference.
``--sweep`` also times other tile sizes and splits per shape (``T`` from ``--sweep-tokens``, 1
and 8 unless given) and prints the fastest, for tuning ``small_linear_config``.

``--target`` times the E2B target's matmuls instead (``TARGET_SHAPES``, per forward: the
verification's rows are ``B (k + 1)``, plain decoding's ``B``), its ``step`` row one forward's,
with the draft's tiles (``small_linear_config``) unless ``--sweep`` tries others.
``--forward`` (with ``--target``) times a whole forward's matmuls as the engine runs them: every
matmul of the forward on a weight of its own (~4.6 GB: none is left in L2 for the next),
captured back to back in one CUDA graph, for cuBLAS, ours with the draft's tiles and with the
target's (``target_config``: ``target_linear``'s, from the 278d557 sweep); us a forward and the
weight bytes read per second. One kernel at a time (the rows above) each matmul pays its start
and drain alone; in a graph they run back to back.
``--norms`` (with ``--forward``) also times each chain with the residual add and RMS norm that
follows every matmul of the hidden width in the target (``HIDDEN``: the attention's output and
the MLP's down projection, the per-layer input projection), compiled by Inductor as vLLM's
graphs compile it (a looped reduction over rows sized for 16384 tokens), and prints what the
norms add to each chain: the norm's cost after cuBLAS against after ours, the same kernel on
the same rows; a fourth chain, ``target unsplit``, runs ours with all of K in one program a
tile, without the partial sums that ours' last program of a tile adds up. Why: the engine's
norms ran slower in the 1-16 token graph on our kernel (``benchmarks/results/h100``,
thirty-seventh and thirty-eighth sessions).

    PYTHONPATH=$PWD python3 benchmarks/small_linear.py --target --tokens 1,3,8,16,24,32,48,64,96
    PYTHONPATH=$PWD python3 benchmarks/small_linear.py --target --tokens 48 --sweep \
        --sweep-tokens 3,24,48,96
    PYTHONPATH=$PWD python3 benchmarks/small_linear.py --target --forward --tokens 1,16,48,96
    PYTHONPATH=$PWD python3 benchmarks/small_linear.py --target --forward --norms --tokens 1,3,4,16
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import (  # noqa: E402
    _time_cpu,
    _time_cuda,
    _time_cuda_chain,
    bench_setup,
    kernel_bench_parser,
)

from gemma4_spec.ops.centroid_argmax_triton import triton_usable  # noqa: E402
from gemma4_spec.ops.small_linear import (  # noqa: E402
    gelu_and_mul,
    small_linear,
    small_linear_gelu_and_mul,
    small_linear_gelu_and_mul_reference,
    small_linear_reference,
)
from gemma4_spec.ops.small_linear_triton import (  # noqa: E402
    SmallLinearConfig,
    small_linear_config,
    small_linear_gelu_and_mul_kernel,
    small_linear_kernel,
    target_config,
)
from gemma4_spec.testing.closeness import largest_value_excess, one_rounding_excess  # noqa: E402

# name: (N, K, matmuls of this shape per draft step)
SHAPES: dict[str, tuple[int, int, int]] = {
    "pre_projection": (256, 3072, 1),
    "q_proj sliding": (2048, 256, 3),
    "o_proj sliding": (256, 2048, 3),
    "q_proj full": (4096, 256, 1),
    "o_proj full": (256, 4096, 1),
    "gate_up_proj": (4096, 256, 4),
    "down_proj": (256, 2048, 4),
    "post_projection": (1536, 256, 1),
}
# The E2B target's matmuls, one forward (vLLM's Gemma 4 layers: hidden 1536; 28 sliding layers
# of 8 heads of 256 and 7 full of 8 of 512, one KV head, QKV as one matmul in every layer; MLP
# 6144, double-wide in the 20 KV-shared layers; per-layer inputs of 256; vocab 262144).
TARGET_SHAPES: dict[str, tuple[int, int, int]] = {
    "qkv sliding": (2560, 1536, 28),
    "qkv full": (5120, 1536, 7),
    "o sliding": (1536, 2048, 28),
    "o full": (1536, 4096, 7),
    "gate_up": (12288, 1536, 15),
    "gate_up double": (24576, 1536, 20),
    "down": (1536, 6144, 15),
    "down double": (1536, 12288, 20),
    "ple gate": (256, 1536, 35),
    "ple projection": (1536, 256, 35),
    "ple model proj": (8960, 1536, 1),
    "lm_head": (262144, 1536, 1),
}
HIDDEN = 1536  # the target's hidden width: the matmuls whose output a norm reads (--norms)
NORM_HINT_ROWS = 16384  # the rows Inductor sizes the norm for (vLLM's compile hint, 0.26)
SMOKE_SHAPES: dict[str, tuple[int, int, int]] = {"wide": (96, 40, 1), "long": (16, 600, 2)}
VARIANTS = ("ours", "cuBLAS", "reference")
GATED = "gate_up_proj"  # the shape the gated rows time
TARGET_GATED = "gate_up"  # with --target
GATED_VARIANTS = ("ours fused", "ours + act", "cuBLAS + act", "reference")


def _sweep_configs(
    rows: int, n: int, k: int, device: torch.device, wide: bool = False
) -> list[SmallLinearConfig]:
    """The launches ``--sweep`` times: tile widths, splits and warps around the default; with
    ``wide`` (``--sweep-wide``, for the target's bandwidth-bound shapes) also K per step and
    pipeline stages, with one split or the default's."""
    base = small_linear_config(rows, n, k, device)
    if wide:  # one row tile past 64 rows too (each row tile reads the whole weight)
        base = base._replace(block_t=min(128, max(16, triton.next_power_of_2(rows))))
    choices = itertools.product(
        (64, 128, 256) if wide else (base.block_k,),  # K a step
        (32, 64, 128) if wide else (16, 32, 64),  # columns a tile
        sorted({1, base.splits} if wide else {1, 2, 4, 8, 16, base.splits}),  # splits
        (4, 8) if wide else (2, 4),  # warps
        (3, 4) if wide else (base.num_stages,),  # stages
    )
    configs = []
    for block_k, block_n, splits, warps, stages in choices:
        steps = triton.cdiv(k, block_k)
        if splits > steps:
            continue
        per = triton.cdiv(steps, splits)
        configs.append(base._replace(
            block_n=block_n, block_k=block_k, splits=triton.cdiv(steps, per),
            steps_per_split=per, num_warps=warps, num_stages=stages,
        ))  # fmt: skip
    return configs


def _add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + rms_norm(y) * weight`` in float32, as Gemma 4's layers add a sublayer's
    normed output to the residual stream (``--norms``)."""
    y32 = y.float()
    normed = y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    return (residual.float() + normed).to(y.dtype)


def compiled_add_rms_norm(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """``_add_rms_norm`` through Inductor with the rows dynamic, compiled first at
    ``NORM_HINT_ROWS`` so its kernel is sized as the engine's are."""
    norm = torch.compile(_add_rms_norm, dynamic=True, fullgraph=True)
    y = torch.randn(NORM_HINT_ROWS, HIDDEN, device=device, dtype=dtype)
    norm(y, y, torch.ones(HIDDEN, device=device, dtype=dtype))
    return norm


def time_forward(
    shapes: dict[str, tuple[int, int, int]],
    tokens: list[int],
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
    norms: bool = False,
) -> list[dict]:
    """``--forward``: each variant's whole forward of matmuls in one CUDA graph (module
    docstring), per row count; with ``norms`` each also with its norms (``--norms``)."""
    weights = [
        torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        for n, k, per_step in shapes.values()
        for _ in range(per_step)
    ]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    norm = compiled_add_rms_norm(device, dtype) if norms else None
    rows_out = []
    print(f"forward: {len(weights)} matmuls, {nbytes / 1e9:.2f} GB of weights, one CUDA graph")
    print(f"{'T':>4s} {'cuBLAS us':>10s} {'ours us':>10s} {'target us':>10s} "
          f"{'cuBLAS TB/s':>11s} {'target TB/s':>10s} {'cuBLAS/target':>12s}")  # fmt: skip
    for t in tokens:
        xs = {
            k: torch.randn(t, k, device=device, dtype=dtype) for k in {w.shape[1] for w in weights}
        }
        pairs = [(xs[w.shape[1]], w) for w in weights]
        chains = {
            "cuBLAS": [partial(torch.nn.functional.linear, x, w) for x, w in pairs],
            "ours": [partial(small_linear_kernel, x, w) for x, w in pairs],
            "target": [
                partial(small_linear_kernel, x, w, target_config(t, *w.shape, device))
                for x, w in pairs
            ],
        }
        if norm is not None:  # is it the partial sums' ending that a norm after ours feels?
            chains["target unsplit"] = [
                partial(small_linear_kernel, x, w, _unsplit(target_config(t, *w.shape, device)))
                for x, w in pairs
            ]
        us = {name: _time_cuda_chain(fns, reps) * len(fns) for name, fns in chains.items()}
        print(f"{t:4d} {us['cuBLAS']:10.1f} {us['ours']:10.1f} {us['target']:10.1f} "
              f"{nbytes / us['cuBLAS'] / 1e6:11.2f} {nbytes / us['target'] / 1e6:10.2f} "
              f"{us['cuBLAS'] / us['target']:12.2f}")  # fmt: skip
        row = {"forward": t, "us": us, "weight_bytes": nbytes}
        if norm is not None:
            row["norms"] = _time_norms(norm, chains, pairs, us, reps)
        rows_out.append(row)
    return rows_out


def _unsplit(cfg: SmallLinearConfig) -> SmallLinearConfig:
    """``cfg`` with all of K in one program a tile (no partial sums)."""
    return cfg._replace(splits=1, steps_per_split=cfg.splits * cfg.steps_per_split)


def _time_norms(
    norm: Callable[..., torch.Tensor],
    chains: dict[str, list[Callable[[], torch.Tensor]]],
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    bare_us: dict[str, float],
    reps: int,
) -> dict[str, dict[str, float]]:
    """``--norms`` at one row count: each chain again with the norm after every matmul of
    ``HIDDEN`` columns, and what the norms added (us a forward, us a norm)."""
    x = pairs[0][0]
    residual = torch.randn(x.shape[0], HIDDEN, device=x.device, dtype=x.dtype)
    scale = torch.ones(HIDDEN, device=x.device, dtype=x.dtype)
    count = sum(w.shape[0] == HIDDEN for _, w in pairs)
    out = {}
    for name, fns in chains.items():
        normed = [
            (lambda fn=fn: norm(fn(), residual, scale)) if w.shape[0] == HIDDEN else fn
            for fn, (_, w) in zip(fns, pairs, strict=True)
        ]
        with_us = _time_cuda_chain(normed, reps) * len(normed)
        added = with_us - bare_us[name]
        out[name] = {"forward_us": with_us, "norms_us": added, "per_norm_us": added / count}
    print(f"     with the {count} norms after each chain's hidden-width matmuls: forward us"
          " without -> with (the norms' us a forward, a norm)")  # fmt: skip
    for n, v in out.items():
        print(f"       {n:15s} {bare_us[n]:8.1f} -> {v['forward_us']:8.1f} "
              f"({v['norms_us']:6.1f}, {v['per_norm_us']:5.2f})")  # fmt: skip
    return out


def main() -> None:
    parser = kernel_bench_parser(
        __doc__.splitlines()[0], "--tokens", "1,2,4,8,16,32,64", cpu_reps=2
    )
    parser.add_argument("--sweep", action="store_true", help="also time other tile sizes")
    parser.add_argument("--sweep-tokens", default="1,8", help="the rows --sweep times")
    parser.add_argument(
        "--sweep-wide", action="store_true", help="--sweep also over K per step and stages"
    )
    parser.add_argument(
        "--sweep-shapes", default="", help="the shapes --sweep times (comma-separated; all)"
    )
    parser.add_argument(
        "--forward", action="store_true", help="with --target: a forward's matmuls in one graph"
    )
    parser.add_argument(
        "--target", action="store_true", help="the E2B target's matmuls, not the draft's"
    )
    parser.add_argument(
        "--norms", action="store_true", help="with --forward: also the norms after the matmuls"
    )
    args = parser.parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    shapes = SMOKE_SHAPES if args.smoke else TARGET_SHAPES if args.target else SHAPES
    # The ops hand rows past SMALL_LINEAR_MAX_ROWS to cuBLAS: the target's rows go to the
    # kernels themselves.
    ours = small_linear_kernel if args.target else small_linear
    fused = small_linear_gelu_and_mul_kernel if args.target else small_linear_gelu_and_mul
    if not triton_usable(device):
        sys.exit("needs CUDA and triton, or TRITON_INTERPRET=1 on CPU")
    if args.norms and not args.forward:
        sys.exit("--norms times the norms in --forward's chains: add --forward --target")
    if args.forward:
        if not (cuda and args.target):
            sys.exit("--forward times the target's forward in a CUDA graph: CUDA and --target")
        tokens = [int(x) for x in args.tokens.split(",")]
        rows = time_forward(shapes, tokens, device, dtype, reps, args.norms)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    flush = torch.empty(64 << 20 if cuda else 1, dtype=torch.float32, device=device)

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        return _time_cuda(fn, reps, flush) if cuda else _time_cpu(fn, reps)

    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        for name, (n, k, _) in shapes.items()
    }
    rows_out: list[dict] = []
    print(f"{'shape':16s} {'N x K':>11s} {'T':>3s} " + " ".join(f"{v:>9s}" for v in VARIANTS)
          + f" {'cuBLAS/ours':>11s} {'splits':>6s} {'ok':>3s}")  # fmt: skip
    for t in [int(x) for x in args.tokens.split(",")]:
        step = dict.fromkeys(VARIANTS, 0.0)
        for name, (n, k, per_step) in shapes.items():
            w = weights[name]
            x = torch.randn(t, k, generator=gen).to(device, dtype)
            fns = {
                "ours": lambda x=x, w=w: ours(x, w),
                "cuBLAS": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "reference": lambda x=x, w=w: small_linear_reference(x, w),
            }
            us = {v: timed(fns[v]) for v in VARIANTS}
            ok = one_rounding_excess(ours(x, w), small_linear_reference(x, w)) <= 0
            splits = small_linear_config(t, n, k, device).splits
            for v in VARIANTS:
                step[v] += per_step * us[v]
            times = " ".join(f"{us[v]:9.2f}" for v in VARIANTS)
            speedup = us["cuBLAS"] / us["ours"]
            print(f"{name:16s} {n:5d}x{k:<5d} {t:3d} {times} {speedup:11.2f} {splits:6d} "
                  f"{'yes' if ok else 'NO':>3s}")  # fmt: skip
            rows_out.append({"shape": name, "n": n, "k": k, "tokens": t, "us": us,
                             "splits": splits, "ok": ok})  # fmt: skip
        print(f"{'step':16s} {'':11s} {t:3d} " + " ".join(f"{step[v]:9.2f}" for v in VARIANTS)
              + f" {step['cuBLAS'] / step['ours']:11.2f}\n")  # fmt: skip
        rows_out.append({"shape": "step", "tokens": t, "us": step})
    gated = TARGET_GATED if args.target else GATED
    n, k, _ = shapes.get(gated, next(iter(shapes.values())))
    w = weights.get(gated, next(iter(weights.values())))
    print(f"gated ({n}x{k} stacked gate/up, then gelu_tanh(gate) * up): "
          + " ".join(f"{v:>12s}" for v in GATED_VARIANTS))  # fmt: skip
    for t in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(t, k, generator=gen).to(device, dtype)
        fns = {
            "ours fused": lambda x=x: fused(x, w),
            "ours + act": lambda x=x: gelu_and_mul(ours(x, w)),
            "cuBLAS + act": lambda x=x: gelu_and_mul(torch.nn.functional.linear(x, w)),
            "reference": lambda x=x: small_linear_gelu_and_mul_reference(x, w),
        }
        us = {v: timed(fns[v]) for v in GATED_VARIANTS}
        ok = largest_value_excess(fused(x, w), small_linear_gelu_and_mul_reference(x, w)) <= 0
        print(f"  T={t:<3d} " + " ".join(f"{us[v]:12.2f}" for v in GATED_VARIANTS)
              + f"  ok {'yes' if ok else 'NO'}")  # fmt: skip
        rows_out.append({"shape": "gated", "n": n, "k": k, "tokens": t, "us": us, "ok": ok})
    if args.sweep:
        print(
            "sweep: the fastest launches per shape (block_n, splits x steps x block_k, warps"
            " stages: us)"
        )
        for t in [int(x) for x in args.sweep_tokens.split(",")]:
            for name, (n, k, _) in shapes.items():
                if args.sweep_shapes and name not in args.sweep_shapes.split(","):
                    continue
                w = weights[name]
                x = torch.randn(t, k, generator=gen).to(device, dtype)
                timings = []
                for cfg in _sweep_configs(t, n, k, device, args.sweep_wide):
                    try:
                        us = timed(lambda cfg=cfg, x=x, w=w: small_linear_kernel(x, w, cfg))
                    except Exception as exc:  # e.g. tiles x stages past shared memory
                        print(f"    skipped {cfg}: {type(exc).__name__}")
                        continue
                    timings.append((us, cfg))
                timings.sort(key=lambda item: item[0])
                default = small_linear_config(t, n, k, device)
                best = ", ".join(
                    f"{c.block_t}x{c.block_n}, {c.splits}x{c.steps_per_split}x{c.block_k}, "
                    f"{c.num_warps}w"
                    f"{c.num_stages}s: {us:.2f}"
                    for us, c in timings[:3]
                )
                default_us = next((us for us, c in timings if c == default), float("nan"))
                print(f"  {name:16s} T={t:<2d} default {default_us:6.2f} | {best}")
                rows_out.append({"sweep": name, "tokens": t, "default_us": default_us,
                                 "best": [(us, c._asdict()) for us, c in timings[:5]]})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
