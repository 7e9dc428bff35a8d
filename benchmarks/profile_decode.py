"""Profile decode steps of one engine (E2B-shaped pair from ``e2e_decode.py``): where the time of
a step goes, CPU and GPU, with torch.profiler. For finding overheads, not for figures.

    python benchmarks/profile_decode.py --workdir /tmp/e2b [--k 2] [--batch 1] [--in-tree]
        [--trace out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/e2b-shaped")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--in-tree", action="store_true", help="vLLM's own gemma4_mtp (V2)")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument("--rows", type=int, default=45)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.in_tree:
        os.environ["VLLM_PLUGINS"] = "none"
    import torch
    from e2e_decode import NEW_TOKENS, PROMPT_LEN, engine_kwargs
    from vllm import LLM, SamplingParams

    from gemma4_spec.testing.e2b_shaped import build_e2b_shaped_pair

    build_e2b_shaped_pair(args.workdir)
    llm = LLM(**engine_kwargs(args.workdir, args.k))
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 200_000 + 10 for j in range(PROMPT_LEN)]}
               for i in range(args.batch)]  # fmt: skip

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)
    step = (run(1 + NEW_TOKENS) - run(1)) / NEW_TOKENS * 1e3
    print(f"decode step {step:.3f} ms (k={args.k}, B={args.batch})", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run(1 + args.tokens)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    print(
        table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70)
    )
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
