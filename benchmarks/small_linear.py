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
within one rounding of the reference. The ``step`` row sums each variant over a draft step's
18 matmuls. ``--sweep`` also times other tile sizes and splits per shape (``T`` = 1 and 8) and
prints the fastest, for tuning ``small_linear_config``.

The draft layer chain (``--chain-only`` for it alone): the assistant's 4 layers' matmuls and the
norms and activation between them, from the pre-projection's output to the post-projection's
(attention left out: the query projection's output is the output projection's input), three
ways: ``unfused`` (today: ``small_linear`` and a separate elementwise kernel between matmuls,
each a torch.compile'd function on CUDA, standing in for Inductor's fused kernels; plain torch
ops on CPU; the output says which), ``fused`` (``ops/draft_prologue.py``: the elementwise work in
the prologue of the next matmul) and ``reference`` (the ops' float32 references). Columns: us
per chain, ``unfused/fused``, and each variant's largest error against the reference relative
to its row's RMS.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import _time_cpu, _time_cuda, bench_setup, kernel_bench_parser  # noqa: E402

from gemma4_spec.ops.centroid_argmax_triton import triton_usable  # noqa: E402
from gemma4_spec.ops.draft_prologue import (  # noqa: E402
    gelu_tanh_mul_linear,
    gelu_tanh_mul_reference,
    residual_reference,
    residual_rms_norm_linear,
    rms_norm_linear,
    rms_norm_reference,
)
from gemma4_spec.ops.small_linear import small_linear, small_linear_reference  # noqa: E402
from gemma4_spec.ops.small_linear_triton import (  # noqa: E402
    SmallLinearConfig,
    small_linear_config,
    small_linear_kernel,
)

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
SMOKE_SHAPES: dict[str, tuple[int, int, int]] = {"wide": (96, 40, 1), "long": (16, 600, 2)}
VARIANTS = ("ours", "cuBLAS", "reference")
# The layer chain: (hidden, MLP width, query width per layer, backbone): the E2B assistant (3
# sliding layers, then a full one) and a small one for --smoke.
CHAIN = (256, 2048, (2048, 2048, 2048, 4096), 1536)
SMOKE_CHAIN = (64, 80, (96, 96, 96, 128), 48)
CHAIN_VARIANTS = ("unfused", "fused", "reference")
EPS = 1e-6
Tensors = dict[str, torch.Tensor]


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within one rounding of ``ref`` in ``out``'s dtype (sums in another order)."""
    eps = torch.finfo(out.dtype).eps
    return bool(((out.float() - ref.float()).abs() <= 2 * eps * ref.float().abs() + 1e-6).all())


def _sweep_configs(rows: int, n: int, k: int, device: torch.device) -> list[SmallLinearConfig]:
    base = small_linear_config(rows, n, k, device)
    steps = triton.cdiv(k, base.block_k)
    configs = []
    for block_n in (16, 32, 64):
        for splits in sorted({1, 2, 4, 8, 16, base.splits}):
            if splits > steps:
                continue
            per = triton.cdiv(steps, splits)
            for warps in (2, 4):
                configs.append(base._replace(block_n=block_n, splits=triton.cdiv(steps, per),
                                             steps_per_split=per, num_warps=warps))  # fmt: skip
    return configs


def _chain_weights(
    sizes: tuple[int, int, tuple[int, ...], int], device: torch.device, dtype: torch.dtype
) -> tuple[list[Tensors], Tensors]:
    """Random weights of the chain: per layer, and the final norm with the post-projection."""
    hidden, inner, queries, backbone = sizes
    gen = torch.Generator().manual_seed(1)

    def matrix(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)

    def gain() -> torch.Tensor:
        return (1 + 0.2 * torch.randn(hidden, generator=gen)).to(device, dtype)

    layers = [
        {"q": matrix(q, hidden), "o": matrix(hidden, q), "gate_up": matrix(2 * inner, hidden),
         "down": matrix(hidden, inner), "input_norm": gain(), "post_attn_norm": gain(),
         "pre_mlp_norm": gain(), "post_mlp_norm": gain(),
         "scalar": torch.rand(1, generator=gen).add(0.5).to(device, dtype)}
        for q in queries
    ]  # fmt: skip
    return layers, {"norm": gain(), "post": matrix(backbone, hidden)}


def _residual_norm(
    a: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    scalar: torch.Tensor | None,
    pre: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused elementwise step between a sub-layer and the next matmul: (h, normed h)."""
    h = residual_reference(a, residual, post, EPS, scalar)
    return h, rms_norm_reference(h, pre, EPS)


class Elementwise(NamedTuple):
    """The unfused chain's steps between matmuls, and the matmul."""

    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    norm: Callable[..., torch.Tensor]
    residual_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    act: Callable[[torch.Tensor], torch.Tensor]


def _unfused_chain(
    h: torch.Tensor, layers: list[Tensors], head: Tensors, ops: Elementwise
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed hidden, post-projection) with a separate step between matmuls."""
    x = ops.norm(h, layers[0]["input_norm"], EPS)
    for idx, w in enumerate(layers):
        attn = ops.linear(ops.linear(x, w["q"]), w["o"])
        h, x = ops.residual_norm(attn, h, w["post_attn_norm"], None, w["pre_mlp_norm"])
        down = ops.linear(ops.act(ops.linear(x, w["gate_up"])), w["down"])
        pre = head["norm"] if idx == len(layers) - 1 else layers[idx + 1]["input_norm"]
        h, x = ops.residual_norm(down, h, w["post_mlp_norm"], w["scalar"], pre)
    return x, ops.linear(x, head["post"])


def _fused_chain(
    h: torch.Tensor, layers: list[Tensors], head: Tensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same chain through the prologue ops (as ``models/gemma4_mtp.fused_layer_chain``)."""
    proj, _ = rms_norm_linear(h, layers[0]["input_norm"], EPS, layers[0]["q"], False)
    for idx, w in enumerate(layers):
        attn = small_linear(proj, w["o"])
        gate_up, h, _ = residual_rms_norm_linear(
            attn, h, w["post_attn_norm"], EPS, None, w["pre_mlp_norm"], EPS, w["gate_up"], False
        )
        down = gelu_tanh_mul_linear(gate_up, w["down"])
        last = idx == len(layers) - 1
        pre, into = (head["norm"], head["post"]) if last else (
            layers[idx + 1]["input_norm"], layers[idx + 1]["q"])  # fmt: skip
        proj, h, x = residual_rms_norm_linear(
            down, h, w["post_mlp_norm"], EPS, w["scalar"], pre, EPS, into, last
        )
    return x, proj


def _unfused_ops(cuda: bool) -> tuple[Elementwise, str]:
    """Today's steps: torch.compile'd (Inductor) on CUDA, else plain torch; and which."""
    if cuda:
        try:
            import torch._dynamo

            torch._dynamo.config.recompile_limit = 64  # one graph per row count and scalar
            compiled = Elementwise(
                small_linear, torch.compile(rms_norm_reference),
                torch.compile(_residual_norm), torch.compile(gelu_tanh_mul_reference),
            )  # fmt: skip
            return compiled, "torch.compile (Inductor) elementwise kernels"
        except Exception as err:  # noqa: BLE001 - any compile failure: time eager instead
            print(f"torch.compile unavailable ({err}); unfused uses plain torch ops")
    plain = Elementwise(small_linear, rms_norm_reference, _residual_norm, gelu_tanh_mul_reference)
    return plain, "plain torch elementwise ops"


def _rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref|`` relative to the RMS of its row of ``ref``."""
    scale = ref.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    return ((out.float() - ref.float()).abs() / scale).max().item()


def chain_rows(
    tokens: list[int],
    sizes: tuple[int, int, tuple[int, ...], int],
    device: torch.device,
    dtype: torch.dtype,
    timed: Callable[[Callable[[], object]], float],
) -> list[dict]:
    """Times the layer chain's three variants at each row count; prints a row each."""
    layers, head = _chain_weights(sizes, device, dtype)
    unfused, how = _unfused_ops(device.type == "cuda")
    reference = Elementwise(
        small_linear_reference, rms_norm_reference, _residual_norm, gelu_tanh_mul_reference
    )
    f32_layers = [{k: v.float() for k, v in w.items()} for w in layers]
    f32_head = {k: v.float() for k, v in head.items()}
    print(f"\ndraft layer chain ({len(layers)} layers; unfused: {how}): us per chain")
    print(f"{'T':>3s} " + " ".join(f"{v:>9s}" for v in CHAIN_VARIANTS)
          + f" {'unfused/fused':>13s} {'err unfused':>11s} {'err fused':>9s}")  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    rows = []
    for t in tokens:
        h = torch.randn(t, sizes[0], generator=gen).to(device, dtype)
        h32 = h.float()
        fns = {
            "unfused": lambda h=h: _unfused_chain(h, layers, head, unfused),
            "fused": lambda h=h: _fused_chain(h, layers, head),
            "reference": lambda h=h32: _unfused_chain(h, f32_layers, f32_head, reference),
        }
        want = fns["reference"]()
        errors = {
            v: max(_rms_error(o, r) for o, r in zip(fns[v](), want, strict=True))
            for v in ("unfused", "fused")
        }
        us = {v: timed(fns[v]) for v in CHAIN_VARIANTS}
        ratio = us["unfused"] / us["fused"]
        print(f"{t:3d} " + " ".join(f"{us[v]:9.2f}" for v in CHAIN_VARIANTS)
              + f" {ratio:13.2f} {errors['unfused']:11.4f} {errors['fused']:9.4f}")  # fmt: skip
        rows.append({"chain": how, "tokens": t, "us": us, "errors": errors})
    return rows


def main() -> None:
    parser = kernel_bench_parser(
        __doc__.splitlines()[0], "--tokens", "1,2,4,8,16,32,64", cpu_reps=2
    )
    parser.add_argument("--sweep", action="store_true", help="also time other tile sizes")
    parser.add_argument("--chain-only", action="store_true", help="only the layer chain")
    args = parser.parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if not triton_usable(device):
        sys.exit("needs CUDA and triton, or TRITON_INTERPRET=1 on CPU")
    flush = torch.empty(64 << 20 if cuda else 1, dtype=torch.float32, device=device)

    def timed(fn: Callable[[], object]) -> float:
        return _time_cuda(fn, reps, flush) if cuda else _time_cpu(fn, reps)  # type: ignore[arg-type]

    tokens = [int(x) for x in args.tokens.split(",")]
    if args.chain_only:
        rows = chain_rows(tokens, SMOKE_CHAIN if args.smoke else CHAIN, device, dtype, timed)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return

    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        for name, (n, k, _) in shapes.items()
    }
    rows_out: list[dict] = []
    print(f"{'shape':16s} {'N x K':>11s} {'T':>3s} " + " ".join(f"{v:>9s}" for v in VARIANTS)
          + f" {'cuBLAS/ours':>11s} {'splits':>6s} {'ok':>3s}")  # fmt: skip
    for t in tokens:
        step = dict.fromkeys(VARIANTS, 0.0)
        for name, (n, k, per_step) in shapes.items():
            w = weights[name]
            x = torch.randn(t, k, generator=gen).to(device, dtype)
            fns = {
                "ours": lambda x=x, w=w: small_linear(x, w),
                "cuBLAS": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "reference": lambda x=x, w=w: small_linear_reference(x, w),
            }
            us = {v: timed(fns[v]) for v in VARIANTS}
            ok = _close(small_linear(x, w), small_linear_reference(x, w))
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
    if args.sweep:
        print("sweep: the fastest launches per shape (block_n, splits x steps, warps: us)")
        for t in (1, 8):
            for name, (n, k, _) in shapes.items():
                w = weights[name]
                x = torch.randn(t, k, generator=gen).to(device, dtype)
                timings = []
                for cfg in _sweep_configs(t, n, k, device):
                    us = timed(lambda cfg=cfg, x=x, w=w: small_linear_kernel(x, w, cfg))
                    timings.append((us, cfg))
                timings.sort(key=lambda item: item[0])
                default = small_linear_config(t, n, k, device)
                best = ", ".join(
                    f"{c.block_n}, {c.splits}x{c.steps_per_split}, {c.num_warps}w: {us:.2f}"
                    for us, c in timings[:3]
                )
                default_us = next((us for us, c in timings if c == default), float("nan"))
                print(f"  {name:16s} T={t:<2d} default {default_us:6.2f} | {best}")
                rows_out.append({"sweep": name, "tokens": t, "default_us": default_us,
                                 "best": [(us, c._asdict()) for us, c in timings[:5]]})  # fmt: skip
    rows_out += chain_rows(tokens, SMOKE_CHAIN if args.smoke else CHAIN, device, dtype, timed)
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
