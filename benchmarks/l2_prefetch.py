"""Does prefetching the target's next weights into L2 speed up a forward? (Experiment.)

An E2B target forward on the GPU is ~600 kernels a step; its 212 matmuls read 4.6 GB of weights
at ~2.0 TB/s in a CUDA graph (``small_linear.py --target --forward``), where the card streams
~3 TB/s: each matmul starts and drains with HBM idle, and the norms, activations and attention
between them read almost nothing. A Hopper thread can ask the memory system to fetch a range
into L2 and go on (``cp.async.bulk.prefetch.L2``): the bytes move while the kernels before
the matmul run. This times a forward-shaped chain in one CUDA graph (per layer, in the
engine's order: norm, QKV, an attention stand-in, output projection, norm, gate/up, the
activation, down, norm, the per-layer input gate, its activation, projection and norm; 35
layers, E2B's widths) with and without such prefetches:

* ``base``: the chain alone.
* ``side L<n>[ <cap> MB][ last]``: before each matmul ``j - n`` starts, a one-warp kernel on a
  second stream (a parallel branch of the graph) asks for matmul ``j``'s weights (those of at
  most ``cap`` MB; ``last``: with the evict-last L2 policy).
* ``inline ...``: the same kernel on the chain's own stream (one launch more a matmul).
* ``attn <weights>``: at each layer's attention stand-in, on the second stream, that layer's
  named weights (the one place a plugin's attention backend could ask from).

Prints us a forward and base over each. Needs torch and triton on a Hopper GPU.

    PYTHONPATH=$PWD python3 benchmarks/l2_prefetch.py [--tokens 8,24,48] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

VOCAB_PLE = 256  # per-layer input width
HIDDEN, INTER, LAYERS, SHARED_FROM = 1536, 6144, 35, 15
SLIDING_Q, FULL_Q, SLIDING_KV, FULL_KV = 2048, 4096, 256, 512

_PLAIN = tl.constexpr(
    "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)
_LAST = tl.constexpr(
    "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $3, 0; "
    "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
    "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
)


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, LAST: tl.constexpr):
    """Each lane asks for one CHUNK of ``base[:nbytes]`` (16-byte multiples) to be read into L2."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = lane.to(tl.int64) * CHUNK
    left = nbytes - start
    ok = left > 0
    size = tl.where(ok, tl.minimum(left, CHUNK), 16).to(tl.int32)
    ptr = base + tl.where(ok, start, 0)
    if LAST:
        tl.inline_asm_elementwise(
            _LAST, "=r,l,r,r", [ptr, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.inline_asm_elementwise(
            _PLAIN, "=r,l,r,r", [ptr, size, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1
        )


CHUNK, LANES = 16384, 32


def prefetch(w: torch.Tensor, last: bool) -> None:
    """Ask for all of ``w``'s bytes in L2 (returns once asked; the bytes move after)."""
    raw = w.view(-1).view(torch.uint8)
    grid = (triton.cdiv(raw.numel(), CHUNK * LANES),)
    _prefetch_kernel[grid](raw, raw.numel(), CHUNK=CHUNK, LANES=LANES, LAST=last, num_warps=1)


@dataclass(frozen=True)
class Variant:
    name: str
    mode: str  # "base", "side" or "inline"
    ahead: int = 1
    cap_mb: float = 1e9
    last: bool = False
    keys: tuple[str, ...] = ()  # mode "attn": the layer's weights asked for at its attention


VARIANTS = [
    Variant("base", "base"),
    Variant("side L1", "side", 1),
    Variant("side L1 last", "side", 1, last=True),
    Variant("side L1 20 MB", "side", 1, 20),
    Variant("side L2 20 MB", "side", 2, 20),
    Variant("side L1 40 MB last", "side", 1, 40, True),
    Variant("inline L1 20 MB", "inline", 1, 20),
    Variant("attn o", "attn", keys=("o",)),
    Variant("attn o down", "attn", keys=("o", "down")),
    Variant("attn o down ple", "attn", keys=("o", "down", "ple_gate", "ple_proj")),
    Variant("attn o down ple last", "attn", last=True, keys=("o", "down", "ple_gate", "ple_proj")),
]


def _norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float() + res.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def _gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return (torch.nn.functional.gelu(g.float(), approximate="tanh") * u.float()).to(gu.dtype)


def _attn_stub(qkv: torch.Tensor, q: int) -> torch.Tensor:
    return torch.tanh(qkv[:, :q].float()).to(qkv.dtype)


def build_weights(device: torch.device, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    layers = []
    for i in range(LAYERS):
        full = (i + 1) % 5 == 0
        q, kv = (FULL_Q, FULL_KV) if full else (SLIDING_Q, SLIDING_KV)
        inter = 2 * INTER if i >= SHARED_FROM else INTER

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=device, dtype=dtype) / k**0.5

        layers.append({
            "qkv": w(q + 2 * kv, HIDDEN), "o": w(HIDDEN, q), "gate_up": w(2 * inter, HIDDEN),
            "down": w(HIDDEN, inter), "ple_gate": w(VOCAB_PLE, HIDDEN),
            "ple_proj": w(HIDDEN, VOCAB_PLE),
        })  # fmt: skip
    return layers


def forward_ops(
    layers: list[dict[str, torch.Tensor]], t: int, device: torch.device, dtype: torch.dtype
) -> list[tuple[torch.Tensor | None, Callable[[], None]]]:
    """The chain as (weight the op reads or None, op), ops writing preallocated buffers, and
    the index of each layer's attention stand-in with the layer's weights."""
    norm = torch.compile(_norm, dynamic=False)
    gelu_mul = torch.compile(_gelu_mul, dynamic=False)
    h = torch.randn(t, HIDDEN, device=device, dtype=dtype)
    scale = torch.ones(HIDDEN, device=device, dtype=dtype)
    ple_in = torch.randn(t, VOCAB_PLE, device=device, dtype=dtype)
    buf: dict[str, torch.Tensor] = {}
    ops: list[tuple[torch.Tensor | None, Callable[[], None]]] = []
    attn_at: dict[int, dict[str, torch.Tensor]] = {}

    def mm(key: str, src: str, w: torch.Tensor) -> None:
        buf[key] = torch.empty(t, w.shape[0], device=device, dtype=dtype)
        ops.append((w, lambda: torch.matmul(buf[src], w.t(), out=buf[key])))

    def elt(key: str, fn: Callable[[], torch.Tensor]) -> None:
        ops.append((None, lambda: buf.__setitem__(key, fn())))

    buf["h"] = h
    for lw in layers:
        q = lw["o"].shape[1]
        elt("x", lambda: norm(buf["h"], buf["h"], scale))
        mm("qkv", "x", lw["qkv"])
        attn_at[len(ops)] = lw
        elt("a", lambda q=q: _attn_stub(buf["qkv"], q))
        mm("o", "a", lw["o"])
        elt("h", lambda: norm(buf["o"], buf["h"], scale))
        mm("gu", "h", lw["gate_up"])
        elt("m", lambda: gelu_mul(buf["gu"]))
        mm("d", "m", lw["down"])
        elt("h", lambda: norm(buf["d"], buf["h"], scale))
        mm("g", "h", lw["ple_gate"])
        elt("g2", lambda: buf["g"] * ple_in)
        mm("p", "g2", lw["ple_proj"])
        elt("h", lambda: norm(buf["p"], buf["h"], scale))
    return ops, attn_at


def _with_prefetch(
    ops: list[tuple[torch.Tensor | None, Callable[[], None]]],
    attn_at: dict[int, dict[str, torch.Tensor]],
    v: Variant,
    side: torch.cuda.Stream,
) -> Callable[[], None]:
    weights = [w for w, _ in ops if w is not None]
    order = {id(w): j for j, w in enumerate(weights)}

    def ask(main: torch.cuda.Stream, ws: list[torch.Tensor]) -> None:
        if v.mode == "inline":
            for w in ws:
                prefetch(w, v.last)
            return
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for w in ws:
                prefetch(w, v.last)

    def run() -> None:
        main = torch.cuda.current_stream()
        for i, (w, op) in enumerate(ops):
            if v.mode == "attn" and i in attn_at:
                ask(main, [attn_at[i][key] for key in v.keys])
            elif w is not None and v.mode in ("side", "inline"):
                j = order[id(w)] + v.ahead
                if j < len(weights) and weights[j].numel() * 2 <= v.cap_mb * 1e6:
                    ask(main, [weights[j]])
            op()
        if v.mode in ("side", "attn"):
            main.wait_stream(side)

    return run


def time_graph(fn: Callable[[], None], reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def check_prefetch(t: int, device: torch.device, dtype: torch.dtype, reps: int) -> None:
    """One matmul per shape after a cold L2 and a ~25 us spin, with and without its weights
    asked for before the spin: what a matmul gains when its weights are already in L2."""
    flush = torch.empty(96 << 20, dtype=torch.uint8, device=device)
    x = {k: torch.randn(t, k, device=device, dtype=dtype) for k in (HIDDEN, SLIDING_Q, INTER)}
    for name, (n, k) in {
        "qkv sliding": (SLIDING_Q + 2 * SLIDING_KV, HIDDEN), "o sliding": (HIDDEN, SLIDING_Q),
        "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER), "ple gate": (VOCAB_PLE, HIDDEN),
    }.items():  # fmt: skip
        w = torch.randn(n, k, device=device, dtype=dtype)
        y = torch.empty(t, n, device=device, dtype=dtype)
        res = {}
        for label, pf in (("cold", None), ("plain", False), ("last", True)):

            def fn(
                pf: bool | None = pf, w: torch.Tensor = w, y: torch.Tensor = y, k: int = k
            ) -> None:
                flush.add_(1)
                if pf is not None:
                    prefetch(w, pf)
                torch.cuda._sleep(50_000)
                torch.matmul(x[k], w.t(), out=y)

            res[label] = time_graph(fn, reps)
        print(f"T={t:3d} {name:12s} {n}x{k}: spin+matmul us cold {res['cold']:.1f}, "
              f"prefetched {res['plain']:.1f} (evict-last {res['last']:.1f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8,24,48")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="variants timed in turn, rounds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    layers = build_weights(device, dtype)
    nbytes = sum(w.numel() * 2 for lw in layers for w in lw.values())
    print(f"{torch.cuda.get_device_name()}: {LAYERS} layers, {nbytes / 1e9:.2f} GB of weights")
    for t in (8, 48):
        check_prefetch(t, device, dtype, args.reps)
    side = torch.cuda.Stream()
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        ops, attn_at = forward_ops(layers, t, device, dtype)
        runs = {v.name: _with_prefetch(ops, attn_at, v, side) for v in VARIANTS}
        us: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(args.rounds):
            for n, fn in runs.items():
                us[n].append(time_graph(fn, args.reps))
        med = {n: statistics.median(x) for n, x in us.items()}
        base = med["base"]
        for n, x in us.items():
            spread = " ".join(f"{y:.1f}" for y in x)
            print(f"T={t:3d} {n:20s} {med[n]:8.1f} us  base/this {base / med[n]:.3f}  "
                  f"rounds {spread}  {nbytes / med[n] / 1e6:.2f} TB/s")  # fmt: skip
        rows.append({"tokens": t, "us": us})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
