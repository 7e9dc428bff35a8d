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
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/e2b-shaped")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--in-tree", action="store_true", help="vLLM's own gemma4_mtp (V2)")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument("--rows", type=int, default=45)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")  # the runner's scopes
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

    def profiled(tokens: int) -> Any:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            run(tokens)
        return prof

    # Per decode step: a run of 1 + N tokens minus a run of 1 (the prefill), divided by N.
    base = _totals(profiled(1).key_averages())
    prof = profiled(1 + args.tokens)
    table = prof.key_averages()
    per_step = {
        name: tuple(
            (a - b) / args.tokens for a, b in zip(row, base.get(name, (0,) * 5), strict=True)
        )
        for name, row in _totals(table).items()
    }
    _print_step_summary(per_step)
    _print_gpu_idle(prof.events(), args.rows)
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    print(
        table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70)
    )
    if args.trace:
        prof.export_chrome_trace(args.trace)


def _totals(table: Any) -> dict[str, tuple[float, float, float, float, float]]:
    """name -> (calls, CPU total us, self CPU us, self device us, 1 if a device event (a
    kernel, copy or memset on the GPU) else 0), from key_averages()."""
    # A scope appears twice (its CPU range and its GPU annotation): keep both, apart.
    return {
        row.key + (" [gpu]" if str(getattr(row, "device_type", "")).endswith("CUDA") else ""): (
            float(row.count),
            float(row.cpu_time_total),
            float(row.self_cpu_time_total),
            float(getattr(row, "self_device_time_total", 0.0)),
            float(str(getattr(row, "device_type", "")).endswith("CUDA")),
        )
        for row in table
    }


SCOPES = ("gpu_model_runner:", "gemma4_spec:")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def _print_step_summary(per_step: dict[str, tuple[float, ...]]) -> None:
    """Per decode step: the runner's and our scopes (CPU time inside each), GPU busy time, and
    the launches and host syncs the CPU made."""
    print("\nper decode step (profiled; the profiler slows the CPU side):")
    for name in sorted(per_step):
        calls, cpu_total = per_step[name][:2]
        if name.startswith(SCOPES) and calls > 0:
            if name.endswith(" [gpu]"):  # from its first to its last kernel, gaps included
                print(f"  {name:45s} {per_step[name][3]:9.1f} us GPU span")
            else:
                print(f"  {name:45s} {cpu_total:9.1f} us CPU   ({calls:.2f} calls)")
    device = {n: row for n, row in per_step.items() if row[4] > 0 and not n.startswith(SCOPES)}
    busy = sum(row[3] for row in device.values())
    kernels = sum(row[0] for row in device.values())
    print(f"  GPU busy (device events)                    {busy:9.1f} us ({kernels:.1f} events)")
    for names, what in ((LAUNCHES, "launches"), (SYNCS, "host syncs")):
        for name in names:
            if name in per_step and per_step[name][0] > 0:
                calls, _, self_cpu = per_step[name][:3]
                print(f"  {what:10s} {name:32s} {calls:7.2f} calls {self_cpu:8.1f} us CPU")
    cpu = sum(row[2] for row in per_step.values())
    print(f"  CPU busy (sum of self CPU time)             {cpu:9.1f} us\n", flush=True)


def _print_gpu_idle(events: Any, rows: int) -> None:
    """Where the GPU waits on the host during the decode steps: the idle gaps between device
    events (kernels, copies, memsets; graph replays show their kernels), each charged to the
    innermost runner or gemma4_spec scope the CPU was in when the gap ended (the work that
    delayed the next launch). Kineto puts CPU and GPU events on one clock."""
    cpu = [e for e in events if not str(e.device_type).endswith("CUDA")]
    cpu_names = {e.name for e in cpu}
    device = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if str(e.device_type).endswith("CUDA") and e.name not in cpu_names
    )
    forwards = sorted(e.time_range.start for e in cpu if e.name == "gpu_model_runner: forward")
    if len(forwards) < 3 or not device:
        print("GPU idle: too few decode steps in the profile\n")
        return
    start, end, steps = forwards[1], device[-1][1], len(forwards) - 1  # skip the prefill step
    scopes = [e for e in cpu if e.name.startswith(SCOPES)]
    idle_by_scope: dict[str, float] = {}
    busy = idle = 0.0
    cursor = start
    for lo, hi in device:
        if hi <= cursor:
            continue
        lo = max(lo, start)
        if lo > cursor:
            gap = lo - cursor
            idle += gap
            inside = [s for s in scopes if s.time_range.start <= lo <= s.time_range.end]
            owner = (
                min(inside, key=lambda s: s.time_range.end - s.time_range.start).name
                if inside
                else "(outside the runner's scopes)"
            )
            idle_by_scope[owner] = idle_by_scope.get(owner, 0.0) + gap
            cursor = lo
        busy += hi - cursor
        cursor = hi
    span = end - start
    print(
        f"GPU timeline over {steps} decode steps: {span / steps:.1f} us per step, "
        f"GPU busy {busy / steps:.1f} us, idle {idle / steps:.1f} us ({idle / span:.0%})"
    )
    print("GPU idle per step, by the CPU scope in which the idle gap ended:")
    for name, gap in sorted(idle_by_scope.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {name:60s} {gap / steps:9.1f} us")
    print(flush=True)


if __name__ == "__main__":
    main()
