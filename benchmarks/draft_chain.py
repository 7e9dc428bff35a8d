"""The assistant's layer chain as a draft step runs it: its matmuls and the norms, residual adds
and activation between them, in one CUDA graph, with the matmuls through cuBLAS (``F.linear``,
what vLLM runs), our small-rows kernel (``ops/small_linear*.py``), and the float32 reference.

    PYTHONPATH=$PWD python3 benchmarks/draft_chain.py [--tokens 1,2,4,8,16,32] [--reps 200]
        [--json out.json] [--smoke]

Needs only torch and triton. The chain: the E2B assistant's 4 layers (3 sliding, 1 full) and
its post-projection; attention is left out (the query projection's output is the output
projection's input), so the chain is 17 matmuls with 14 elementwise steps between them, each a
torch.compile'd (Inductor) kernel on CUDA as in the compiled draft model. Every variant is
captured in a CUDA graph and timed by ``centroid_argmax.py``'s harness (cold L2 before each
replay, CUDA events, the median of ``--reps``); the kernel isolated from its neighbours
(``small_linear.py``) leaves out what its neighbours in the graph cost it or save it.
Columns: us per chain, ``cuBLAS/ours``, and each variant's largest error against the reference
relative to its row's RMS. On CPU (``--smoke``, ``TRITON_INTERPRET=1``) it only checks that the
chain runs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import _time_cpu, _time_cuda, bench_setup, kernel_bench_parser  # noqa: E402

from gemma4_spec.ops.centroid_argmax_triton import triton_usable  # noqa: E402
from gemma4_spec.ops.small_linear import small_linear, small_linear_reference  # noqa: E402

# (hidden, MLP width, query width per layer, backbone): the E2B assistant; a small one for CPU.
CHAIN = (256, 2048, (2048, 2048, 2048, 4096), 1536)
SMOKE_CHAIN = (64, 80, (96, 96, 96, 128), 48)
VARIANTS = ("cuBLAS", "ours", "reference")
EPS = 1e-6
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


def _gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate.float(), approximate="tanh") * up.float()).to(up.dtype)


def _weights(
    sizes: tuple[int, int, tuple[int, ...], int], device: torch.device, dtype: torch.dtype
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    hidden, inner, queries, backbone = sizes
    gen = torch.Generator().manual_seed(1)

    def matrix(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)

    def gain() -> torch.Tensor:
        return (1 + 0.2 * torch.randn(hidden, generator=gen)).to(device, dtype)

    layers = [
        {"q": matrix(q, hidden), "o": matrix(hidden, q), "gate_up": matrix(2 * inner, hidden),
         "down": matrix(hidden, inner), "input_norm": gain(), "post_attn_norm": gain(),
         "pre_mlp_norm": gain(), "post_mlp_norm": gain()}
        for q in queries
    ]  # fmt: skip
    return layers, {"norm": gain(), "post": matrix(backbone, hidden)}


def chain(
    h: torch.Tensor,
    layers: list[dict[str, torch.Tensor]],
    head: dict[str, torch.Tensor],
    linear: Linear,
    ops: tuple[Callable[..., torch.Tensor], Callable[..., tuple[torch.Tensor, torch.Tensor]],
               Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:  # fmt: skip
    """The post-projection of the chain's output (module docstring)."""
    norm, residual_norm, act = ops
    x = norm(h, layers[0]["input_norm"])
    for idx, w in enumerate(layers):
        h, x = residual_norm(linear(linear(x, w["q"]), w["o"]), h, w["post_attn_norm"],
                             w["pre_mlp_norm"])  # fmt: skip
        down = linear(act(linear(x, w["gate_up"])), w["down"])
        pre = head["norm"] if idx == len(layers) - 1 else layers[idx + 1]["input_norm"]
        h, x = residual_norm(down, h, w["post_mlp_norm"], pre)
    return linear(x, head["post"])


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
    plain_ops = (_norm, _residual_norm, _gelu_mul)
    ops = plain_ops
    if cuda:
        torch._dynamo.config.recompile_limit = 64  # one graph per row count
        ops = (torch.compile(_norm), torch.compile(_residual_norm), torch.compile(_gelu_mul))
    linears: dict[str, Linear] = {"cuBLAS": torch.nn.functional.linear, "ours": small_linear}
    print(f"draft layer chain, {len(layers)} layers ({dtype}): us per chain")
    print(f"{'T':>3s} " + " ".join(f"{v:>9s}" for v in VARIANTS)
          + f" {'cuBLAS/ours':>11s} "
          + " ".join(f"{'err ' + v:>12s}" for v in VARIANTS if v != "reference"))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        h = torch.randn(t, layers[0]["q"].shape[1], generator=gen).to(device, dtype)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            v: (lambda v=v, h=h: chain(h, layers, head, linears[v], ops)) for v in linears
        }
        fns["reference"] = lambda h=h: chain(h.float(), layers32, head32, small_linear_reference,
                                            plain_ops)  # fmt: skip
        want = fns["reference"]()
        outs = {v: fns[v]() for v in VARIANTS if v != "reference"}
        errors = {v: _rms_error(o, want) for v, o in outs.items()}
        us = {v: timed(fns[v]) for v in VARIANTS}
        print(f"{t:3d} " + " ".join(f"{us[v]:9.2f}" for v in VARIANTS)
              + f" {us['cuBLAS'] / us['ours']:11.2f} "
              + " ".join(f"{errors[v]:12.4f}" for v in errors))  # fmt: skip
        rows.append({"tokens": t, "us": us, "errors": errors})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
