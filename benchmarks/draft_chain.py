"""The assistant's layer chain as a draft step runs it: its matmuls and the norms, residual adds,
query norm and rotary embedding and activation between them, in one CUDA graph, with the
matmuls through cuBLAS (``F.linear``, what vLLM runs), our small-rows kernel
(``ops/small_linear*.py``), our kernel with the fused draft ops (``ours fused``: the gate/up
matmul and activation in one launch, ``small_linear_gelu_and_mul``, and the query norm and
rotary embedding in one, ``q_norm_rope``), and the float32 reference.

    PYTHONPATH=$PWD python3 benchmarks/draft_chain.py [--tokens 1,2,4,8,16,32] [--reps 200]
        [--json out.json] [--smoke]

Needs only torch and triton. The chain: the E2B assistant's 4 layers (3 sliding, 1 full; 8 query
heads) and its post-projection; attention is left out (the rotated queries are the output
projection's input), so the chain is 17 matmuls with 18 elementwise steps between them, each a
torch.compile'd (Inductor) kernel on CUDA as in the compiled draft model (the query norm and
rotary embedding: vLLM's formula, ``q_norm_rope.py``'s ``vllm_formula``, Inductor's two).
Every variant is captured in a CUDA graph and timed by ``centroid_argmax.py``'s harness (cold
L2 before each replay, CUDA events, the median of ``--reps``); the kernel isolated from its
neighbours (``small_linear.py``) leaves out what its neighbours in the graph cost it or save
it. Columns: us per chain, ``cuBLAS/ours``, ``ours/fused``, and each variant's largest error
against the reference relative to its row's RMS. On CPU (``--smoke``, ``TRITON_INTERPRET=1``)
it only checks that the chain runs. Before the thirty-first session the chain had no query
norm and rotary embedding: its earlier figures are not comparable.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import _time_cpu, _time_cuda, bench_setup, kernel_bench_parser  # noqa: E402
from q_norm_rope import EPS, MAX_POSITION, rotary_cache, vllm_formula  # noqa: E402

from gemma4_spec.ops.centroid_argmax_triton import triton_usable  # noqa: E402
from gemma4_spec.ops.q_norm_rope import q_norm_rope, q_norm_rope_reference  # noqa: E402
from gemma4_spec.ops.small_linear import (  # noqa: E402
    gelu_and_mul_formula,
    small_linear,
    small_linear_gelu_and_mul,
    small_linear_gelu_and_mul_reference,
    small_linear_reference,
)

# (hidden, MLP width, query width per layer, backbone): the E2B assistant; a small one for CPU.
CHAIN = (256, 2048, (2048, 2048, 2048, 4096), 1536)
SMOKE_CHAIN = (64, 80, (96, 96, 96, 128), 48)
VARIANTS = ("cuBLAS", "ours", "ours fused", "reference")
HEADS = 8
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """RMS norm in float32, the result in ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * gain.float()).to(x.dtype)


def _residual_norm(
    a: torch.Tensor, h: torch.Tensor, post: torch.Tensor, pre: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sub-layer's output normed and added to the residual, and that sum normed for the next."""
    h = h + _norm(a, post)
    return h, _norm(h, pre)


def _weights(
    sizes: tuple[int, int, tuple[int, ...], int], device: torch.device, dtype: torch.dtype
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    hidden, inner, queries, backbone = sizes
    gen = torch.Generator().manual_seed(1)

    def matrix(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)

    def gain(size: int = hidden) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(size, generator=gen)).to(device, dtype)

    layers = [
        {"q": matrix(q, hidden), "o": matrix(hidden, q), "gate_up": matrix(2 * inner, hidden),
         "down": matrix(hidden, inner), "input_norm": gain(), "post_attn_norm": gain(),
         "pre_mlp_norm": gain(), "post_mlp_norm": gain(), "q_norm": gain(q // HEADS),
         "rotary": rotary_cache(q // HEADS, device, dtype),
         "layer_scalar": torch.ones(1, device=device, dtype=dtype)}
        for q in queries
    ]  # fmt: skip
    return layers, {"norm": gain(), "post": matrix(backbone, hidden)}


class ChainOps(NamedTuple):
    """How a variant runs each step of the chain."""

    linear: Linear
    norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    residual_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gate_up_act: Linear  # (x, stacked gate/up weight) -> gelu_tanh(gate) * up
    q_rope: Callable[..., torch.Tensor]  # (q, gain, cache, positions, eps, head_dim)


def chain(
    h: torch.Tensor,
    positions: torch.Tensor,
    layers: list[dict[str, torch.Tensor]],
    head: dict[str, torch.Tensor],
    ops: ChainOps,
) -> torch.Tensor:
    """The post-projection of the chain's output (module docstring)."""
    x = ops.norm(h, layers[0]["input_norm"])
    for idx, w in enumerate(layers):
        head_dim = w["q_norm"].shape[0]
        q = ops.q_rope(ops.linear(x, w["q"]), w["q_norm"], w["rotary"], positions, EPS, head_dim)
        h, x = ops.residual_norm(ops.linear(q, w["o"]), h, w["post_attn_norm"], w["pre_mlp_norm"])
        down = ops.linear(ops.gate_up_act(x, w["gate_up"]), w["down"])
        pre = head["norm"] if idx == len(layers) - 1 else layers[idx + 1]["input_norm"]
        h, x = ops.residual_norm(down, h, w["post_mlp_norm"], pre)
    return ops.linear(x, head["post"])


def _variants(cuda: bool) -> dict[str, ChainOps]:
    """Each variant's ops; on CUDA the elementwise steps are Inductor's kernels, as in the
    compiled draft model."""
    compiled = torch.compile if cuda else (lambda fn: fn)
    norm, residual_norm = compiled(_norm), compiled(_residual_norm)
    act, q_rope = compiled(gelu_and_mul_formula), compiled(vllm_formula)

    def unfused(linear: Linear) -> ChainOps:
        return ChainOps(linear, norm, residual_norm, lambda x, w: act(linear(x, w)), q_rope)

    return {
        "cuBLAS": unfused(torch.nn.functional.linear),
        "ours": unfused(small_linear),
        "ours fused": ChainOps(
            small_linear, norm, residual_norm, small_linear_gelu_and_mul, q_norm_rope
        ),
        "reference": ChainOps(
            small_linear_reference,
            _norm,
            _residual_norm,
            small_linear_gelu_and_mul_reference,
            q_norm_rope_reference,
        ),
    }


def _rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|out - ref|`` relative to the RMS of its row of ``ref``."""
    scale = ref.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    return ((out.float() - ref.float()).abs() / scale).max().item()


def main() -> None:
    parser = kernel_bench_parser(__doc__.splitlines()[0], "--tokens", "1,2,4,8,16,32", 2)
    args = parser.parse_args()
    device, dtype, cuda, reps = bench_setup(args)
    if not triton_usable(device):
        sys.exit("needs CUDA and triton, or TRITON_INTERPRET=1 on CPU")
    flush = torch.empty(64 << 20 if cuda else 1, dtype=torch.float32, device=device)

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        return _time_cuda(fn, reps, flush) if cuda else _time_cpu(fn, reps)

    layers, head = _weights(SMOKE_CHAIN if args.smoke else CHAIN, device, dtype)
    layers32 = [{k: v.float() for k, v in w.items()} for w in layers]
    head32 = {k: v.float() for k, v in head.items()}
    if cuda:
        torch._dynamo.config.recompile_limit = 64  # one graph per row count
    ops = _variants(cuda)
    print(f"draft layer chain, {len(layers)} layers ({dtype}): us per chain")
    print(f"{'T':>3s} " + " ".join(f"{v:>10s}" for v in VARIANTS)
          + f" {'cuBLAS/ours':>11s} {'ours/fused':>10s} "
          + " ".join(f"{'err ' + v:>14s}" for v in VARIANTS if v != "reference"))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        h = torch.randn(t, layers[0]["q"].shape[1], generator=gen).to(device, dtype)
        positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(device)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            v: (lambda v=v, h=h, p=positions: chain(h, p, layers, head, ops[v]))
            for v in VARIANTS
            if v != "reference"
        }
        fns["reference"] = lambda h=h, p=positions: chain(
            h.float(), p, layers32, head32, ops["reference"]
        )
        want = fns["reference"]()
        errors = {v: _rms_error(fns[v](), want) for v in VARIANTS if v != "reference"}
        us = {v: timed(fns[v]) for v in VARIANTS}
        print(f"{t:3d} " + " ".join(f"{us[v]:10.2f}" for v in VARIANTS)
              + f" {us['cuBLAS'] / us['ours']:11.2f} {us['ours'] / us['ours fused']:10.2f} "
              + " ".join(f"{errors[v]:14.4f}" for v in errors))  # fmt: skip
        rows.append({"tokens": t, "us": us, "errors": errors})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
