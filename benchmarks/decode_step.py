"""Decode time with and without speculation, ours vs vLLM's in-tree gemma4_mtp, side by side.

    .venv/bin/python benchmarks/decode_step.py [--k 3] [--batch 4] [--max-tokens 64]

Builds the tiny local pair (random weights, 'copy' assistant), then times steady-state
``LLM.generate`` (after a warm-up; prompts are prefix-cached, so this is decoding) for: no
speculation, our plugin (centroid and full-vocab assistants) and the in-tree proposer (full-vocab
assistant only: with centroids it crashes on CPU). Each plugin setting runs in its own process
(``VLLM_PLUGINS``). Prints seconds per generated token and each run's ratio to no speculation.
Random weights accept few drafts, so the ratios are mostly the cost of drafting + verifying.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def _worker(spec: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from gemma4_spec.testing.engine_run import RunConfig, engine_kwargs

    prompts = spec["prompts"]
    results = {}
    for name, assistant in spec["runs"].items():
        config = RunConfig(
            target=spec["target"],
            prompts=prompts,
            assistant=assistant,
            num_speculative_tokens=spec["k"],
            max_model_len=1024,
            dtype=spec["dtype"],
        )
        llm = LLM(**engine_kwargs(config, single_process=True))
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(inputs, params, use_tqdm=False)  # warm-up, fills the prefix cache
        best = float("inf")
        for _ in range(spec["reps"]):
            start = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        results[name] = best / spec["max_tokens"]
        del llm
    print("RESULT " + json.dumps(results), flush=True)


def _run(spec: dict, plugins: str | None) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return

    from gemma4_spec.testing.tiny import build_tiny_assistant, build_tiny_pair

    target, centroids = build_tiny_pair(args.workdir, centroids=True)
    full_vocab = build_tiny_assistant(
        args.workdir / "assistant-full-vocab", target, centroids=False
    )
    rng = random.Random(0)
    spec = dict(
        target=str(target),
        prompts=[
            [rng.randrange(3, 2048) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ],
        k=args.k,
        max_tokens=args.max_tokens,
        reps=args.reps,
        dtype=args.dtype,
    )
    ours = _run(
        dict(
            spec,
            runs={"plain": None, "ours-centroids": str(centroids), "ours-full": str(full_vocab)},
        ),
        plugins=None,
    )
    in_tree = _run(dict(spec, runs={"in-tree-full": str(full_vocab)}), plugins="none")
    times = {**ours, **in_tree}
    print(
        f"batch {args.batch} x {args.prompt_len}-token prompts, {args.max_tokens} new tokens, "
        f"k={args.k}, {args.dtype}, CPU"
    )
    print(f"{'run':<16}{'ms / token':>12}{'vs plain':>10}")
    for name, seconds in times.items():
        print(f"{name:<16}{seconds * 1e3:>12.2f}{seconds / times['plain']:>9.2f}x")
    print(f"ours-full vs in-tree-full: {times['ours-full'] / times['in-tree-full']:.2f}x time")


if __name__ == "__main__":
    main()
