"""Tile sizes, warps, stages and programs per SM of the full-vocabulary argmax kernel, swept on
a GPU at the real dims (H=1024, V=262144, bf16; CUDA graphs, cold L2, the harness of
``centroid_argmax.py``). Prints, per T, every configuration's median us ("!" where its tokens
differ from the float32 reference on a row clear of near-ties) and the five fastest, with the
default (``vocab_argmax_config``) marked "*"; ``--json`` keeps every row (rewritten after each T, so
a run stopped at its time limit keeps the T it finished). Each new tile shape compiles first
(a few seconds each): the whole sweep takes several minutes.

    PYTHONPATH=$PWD python3 benchmarks/vocab_argmax_sweep.py [--tokens 1,16,64,128,256,512]
        [--reps 100] [--json sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from centroid_argmax import _time_cuda  # noqa: E402
from vocab_argmax import REAL  # noqa: E402

from gemma4_spec.ops.vocab_argmax import vocab_argmax_reference  # noqa: E402
from gemma4_spec.ops.vocab_argmax_triton import (  # noqa: E402
    VocabArgmaxConfig,
    vocab_argmax,
    vocab_argmax_config,
)

BLOCK_V = (64, 128, 256)
BLOCK_K = (64, 128)
WARPS_STAGES = ((4, 3), (4, 4), (8, 3), (8, 4))
PROGRAMS_PER_SM = (1, 2, 4)
SMEM = 227 * 1024  # bytes one program may use on the H200


def candidates(num_tokens: int, sms: int) -> list[VocabArgmaxConfig]:
    """The default, then every combination whose pipelined tiles fit shared memory; for T
    above 64 also twice the default token block."""
    default = vocab_argmax_config(num_tokens, REAL[0], REAL[1], torch.device("cuda"))
    block_ts = [default.block_t] + ([2 * default.block_t] if num_tokens > 64 else [])
    out = [default]
    for bt, bv, bk, (w, st), pps in itertools.product(
        block_ts, BLOCK_V, BLOCK_K, WARPS_STAGES, PROGRAMS_PER_SM
    ):
        if (bv + bt) * bk * 2 * st > SMEM or bv * bt > 128 * 256:
            continue
        blocks = -(-num_tokens // bt)
        cfg = VocabArgmaxConfig(bt, bv, bk, max(1, sms * pps // blocks), w, st)
        if cfg not in out:
            out.append(cfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="1,16,64,128,256,512")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    vocab, hidden_size = REAL
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, hidden_size, generator=gen).to(device, torch.bfloat16)
    flush = torch.zeros(64 * 2**20, dtype=torch.float32, device=device)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(t, hidden_size, generator=gen).to(device, torch.bfloat16)
        logits = hidden.float() @ lm_head.float().t()
        top = logits.topk(2, dim=1).values
        clear = (top[:, 0] - top[:, 1]) > 1e-4 * (1 + top[:, 0].abs())
        want = vocab_argmax_reference(hidden, lm_head)
        timed = []
        for i, cfg in enumerate(candidates(t, sms)):
            try:
                got = vocab_argmax(hidden, lm_head, config=cfg)
                run = lambda h=hidden, c=cfg: vocab_argmax(h, lm_head, config=c)  # noqa: E731
                us = _time_cuda(run, args.reps, flush)
            except Exception as exc:  # e.g. out of shared memory or registers
                print(f"T={t} {tuple(cfg)} failed: {type(exc).__name__}"[:160])
                continue
            wrong = bool((clear & (got != want)).any())
            timed.append((us, i == 0, wrong, cfg))
            rows.append({"tokens": t, "config": cfg._asdict(), "median_us": us, "wrong": wrong})
            mark = ("*" if i == 0 else " ") + ("!" if wrong else " ")
            print(f"T={t:>4} {mark} {us:>8.1f} us  {tuple(cfg)}", flush=True)
        timed.sort(key=lambda x: x[0])
        default_us = next((f"{us:.1f} us" for us, is_default, _, _ in timed if is_default), "-")
        print(f"T={t}: default {default_us}; fastest:")
        for us, is_default, wrong, cfg in timed[:5]:
            print(f"   {us:>8.1f} {'*' if is_default else ' '}{'!' if wrong else ' '} {cfg}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
