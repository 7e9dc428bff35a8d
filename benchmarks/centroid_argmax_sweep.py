"""Block sizes and warps of the centroid-major path's kernels, swept on a GPU (real E2B / E4B
dims, bf16, CUDA graphs, cold L2, the harness of ``centroid_argmax.py``).

Each row sets the module constants it names (the rest at their defaults) and times, per T: the
whole centroid path ("path"; "!" marks a T whose tokens differ from the fp32 reference), or its
first two kernels ("select": scores and rank top-k), or its first ("scores"), or the persistent
kernel ("persistent", up to T = 4). The H200 runs that chose the defaults:
``benchmarks/results/h200/centroid_sweep-*.log``.

    python benchmarks/centroid_argmax_sweep.py [--tokens 1,2,4,5,8,16,32,64,256] [--reps 200]
        [--kinds path,select,scores,persistent]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import REAL, _time_cuda  # noqa: E402

from gemma4_spec.ops import centroid_argmax_triton as m  # noqa: E402
from gemma4_spec.ops.centroid_argmax import CentroidMask  # noqa: E402

# (kind, constants): kind is what is timed. The first row of a kind is the defaults.
ROWS: list[tuple[str, dict[str, int]]] = [
    *[
        ("path", dict(CENTROID_SPLIT=s, CENTROID_BLOCK_R=r, CENTROID_BLOCK_D=d,
                      CENTROID_WARPS=w))
        for s, r, d, w in [(2, 64, 64, 4), (1, 128, 64, 4), (2, 64, 64, 2), (4, 32, 64, 4),
                           (2, 64, 128, 4)]
    ],
    ("select", dict(SELECT_BLOCK_I=64, SELECT_WARPS=8, SELECT_GROUPS_PER_K=4)),
    ("scores", dict(SCORES_DOT_BLOCK_C=64, SCORES_WARPS=4)),
    *[
        ("persistent", dict(PERSISTENT_GROUPS_PER_K=g, PERSISTENT_RANK_IN_REGISTERS=i,
                            PERSISTENT_WARPS=w, PERSISTENT_PROGRAMS=p))
        for g, i, w, p in [
            (2, 65536, 8, 128), (4, 65536, 8, 128), (1, 65536, 8, 128), (2, 65536, 16, 128),
            (4, 65536, 16, 128), (2, 65536, 4, 128), (2, 0, 8, 128), (2, 65536, 8, 64),
        ]
    ],
]  # fmt: skip
PERSISTENT_MAX_TOKENS = 4  # the persistent rows are timed up to this T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,5,8,16,32,64,256")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--kinds", default="path,select,scores,persistent", help="rows to run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    vocab, centroids, top_k, d = REAL
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, d, generator=gen).cuda().bfloat16()
    cw = torch.randn(centroids, d, generator=gen).cuda().bfloat16()
    mask = CentroidMask(cw, torch.randperm(vocab, generator=gen).cuda(), top_k)
    state = m._state_for(mask, vocab)
    flush = torch.zeros(64 * 2**20, device="cuda")
    tokens = [int(t) for t in args.tokens.split(",")]
    hidden = {t: torch.randn(t, d, generator=gen).cuda().bfloat16() for t in tokens}
    want = {t: m.centroid_argmax_fp32_reference(hidden[t], lm_head, mask) for t in tokens}
    defaults = {name: getattr(m, name) for _, row in ROWS for name in row}
    print(f"us per call at T = {tokens}; defaults {defaults}")
    for kind, row in ROWS:
        if kind not in args.kinds.split(","):
            continue
        for name, value in dict(defaults, **row).items():
            setattr(m, name, value)
        cells = []
        for t in tokens:
            h = hidden[t]
            fn: Callable[[], torch.Tensor]
            if kind == "persistent" and t > PERSISTENT_MAX_TOKENS:
                cells.append(f"{'-':>6} ")
                continue
            if kind == "persistent":
                m._PERSISTENT_PROGRAMS.clear()  # its P depends on the row's constants
                fn = lambda h=h: m.centroid_argmax_persistent(mask, h, lm_head, state)  # noqa: E731
            elif kind == "path":
                fn = lambda h=h: m.centroid_argmax_centroid_major(mask, h, lm_head, state)  # noqa: E731
            elif kind == "select":
                fn = lambda h=h: m.select_centroids_ranked(state, h, cw)[0]  # noqa: E731
            else:
                fn = lambda h=h: m.centroid_scores(state, h, cw)[0]  # noqa: E731
            us = _time_cuda(fn, args.reps, flush)
            wrong = kind in ("path", "persistent") and not bool((fn() == want[t]).all())
            cells.append(f"{us:6.1f}{'!' if wrong else ' '}")
        print(f"{kind:6} {row} | " + " ".join(cells), flush=True)
    for name, value in defaults.items():
        setattr(m, name, value)


if __name__ == "__main__":
    main()
