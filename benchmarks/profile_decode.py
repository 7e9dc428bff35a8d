"""Profile decode steps of one engine: where the time of a step goes, CPU and GPU, with
torch.profiler. For finding overheads, not for figures. The pairs and engine variants are
``real_work.py``'s (``--pair trained``: the shipped pair, real acceptance; ``e2b``: random
E2B-shaped weights, nothing accepted unless ``--acceptance`` picks one of vLLM's synthetic
profiles).

    python benchmarks/profile_decode.py --pair trained --variant ours-V2 --k 3 --batch 16
        [--trace out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import cprofile_rows  # noqa: E402
import real_work  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=real_work.PAIRS, default="e2b")
    parser.add_argument(
        "--variant",
        default="ours-V1",
        type=real_work.engine_variant,
        help=real_work.ENGINE_VARIANTS_HELP,
    )
    parser.add_argument("--workdir", default="/tmp/real-work")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs before profiling")
    parser.add_argument("--lock", default=None, help="measure under this file lock")
    parser.add_argument(
        "--draft-argmax",
        choices=("ours", "centroid-major", "full-logits"),
        default="ours",
        help="diagnostic: the greedy draft through our kernel's auto path, its centroid-major "
        "path only, or full-vocabulary logits and argmax (in this process)",
    )
    real_work.add_acceptance_option(parser)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument(
        "--kernels-json",
        default=None,
        help="also write each device kernel's time per output token here (one file per batch "
        "size, -b<B> before the suffix), for benchmarks/kernel_diff.py",
    )
    parser.add_argument("--rows", type=int, default=45)
    parser.add_argument(
        "--graph-census",
        action="store_true",
        help="also count CUDA-graph replays per output token by the code that replays them",
    )
    parser.add_argument(
        "--py-profile",
        action="store_true",
        help="also profile the Python side with cProfile (engine core in this process): the "
        "functions with the most time per output token, own and cumulative",
    )
    args = parser.parse_args()
    real_work.enter_variant(args.variant)  # before the draft-argmax choice imports vLLM
    os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")  # the runner's scopes
    _choose_draft_argmax(args.draft_argmax)
    llm, target = real_work.start_profiled(parser, args)
    batches = [int(b) for b in args.batch.split(",")]
    all_prompts = real_work._prompts(args.pair, target, max(batches))
    for batch in batches:
        with _exclusive(args.lock):
            _profile_batch(llm, all_prompts[:batch], args, batch)


def _choose_draft_argmax(choice: str) -> None:
    """Replaces the assistant's greedy draft in this process (the engine core runs here)."""
    if choice == "ours":
        return
    from gemma4_spec.models.gemma4_mtp import Gemma4AssistantForDrafting
    from gemma4_spec.ops.centroid_argmax_triton import centroid_argmax_fused

    def get_top_tokens(self: Any, hidden_states: Any) -> Any:
        mask = self._centroid_mask()
        if choice == "full-logits" or mask is None:
            return self.compute_logits(hidden_states).argmax(dim=-1)
        return centroid_argmax_fused(mask, hidden_states, self.lm_head.weight, path="centroid")

    Gemma4AssistantForDrafting.get_top_tokens = get_top_tokens  # type: ignore[method-assign]
    print(f"diagnostic: greedy drafts through {choice}", flush=True)


@contextlib.contextmanager
def _exclusive(lock: str | None) -> Iterator[None]:
    """With ``--lock``, engines started side by side measure one at a time (start-up overlaps,
    the measured steps do not share the host)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _profile_batch(llm: Any, prompts: list[Any], args: argparse.Namespace, batch: int) -> None:
    import torch
    from vllm import SamplingParams

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)
    new_tokens = real_work.NEW_TOKENS
    steps = sorted((run(1 + new_tokens) - run(1)) / new_tokens * 1e3 for _ in range(args.repeats))
    print(
        f"\n===== {args.variant} ({args.draft_argmax}) k={args.k} B={batch}: "
        "ms per output token of a request, "
        f"median {statistics.median(steps):.3f} (of {', '.join(f'{x:.3f}' for x in steps)})",
        flush=True,
    )

    def profiled(tokens: int) -> Any:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            # One annotation every profile has, whatever the engine: where the profiler flags
            # its GPU side, ``_device_events`` knows the flag is there to read.
            with torch.profiler.record_function(RUN_SCOPE):
                run(tokens)
        return prof

    if args.graph_census:
        _print_graph_census(run, args.tokens)
    if args.py_profile:
        _print_python_profile(run, args.tokens, args.rows)
    # Per output token: a run of 1 + N tokens minus a run of 1 (the prefill), divided by N.
    base_prof = profiled(1)
    base = _totals(base_prof.key_averages())
    prof = profiled(1 + args.tokens)
    table = prof.key_averages()
    per_step = {
        name: tuple(
            (a - b) / args.tokens for a, b in zip(row, base.get(name, (0,) * 5), strict=True)
        )
        for name, row in _totals(table).items()
    }
    _print_step_summary(per_step)
    _print_gpu_idle(prof.events(), args.rows, args.tokens)
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    print(
        table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70)
    )
    if args.trace:
        prof.export_chrome_trace(args.trace.replace(".json", f"-b{batch}.json"))
    if args.kernels_json:
        full, once = _kernel_times(prof.events()), _kernel_times(base_prof.events())
        per_token = {
            name: [(n - once.get(name, (0, 0.0))[0]) / args.tokens,
                   (us - once.get(name, (0, 0.0))[1]) / args.tokens]
            for name, (n, us) in full.items()
        }  # fmt: skip
        record = {"variant": args.variant, "k": args.k, "batch": batch, "kernels": per_token}
        Path(args.kernels_json.replace(".json", f"-b{batch}.json")).write_text(
            json.dumps(record, indent=1)
        )


def _kernel_times(events: Any) -> dict[str, tuple[int, float]]:
    """Device events by name: how many ran and their summed duration in us, from the
    profiler's timeline."""
    times: dict[str, tuple[int, float]] = {}
    for e in _device_events(events):
        n, us = times.get(e.name, (0, 0.0))
        times[e.name] = (n + 1, us + e.time_range.end - e.time_range.start)
    return times


def _on_device(event: Any) -> bool:
    return str(event.device_type).endswith("CUDA")


def _device_events(events: Any) -> list[Any]:
    """The timeline's device events: kernels, copies, memsets (a graph replay shows its
    kernels). A scope's GPU annotation (``record_function`` seen on the device) is left out.
    The profiler flags those (``is_user_annotation``); a name shared with a CPU event does not
    tell them apart, since Inductor launches its Triton kernels inside scopes named after them:
    judged by name, every kernel of the target that Inductor generated and that also ran
    eagerly (its prefill) went missing from the kernel times and counted as GPU idle."""
    device = [e for e in events if _on_device(e)]
    if any(getattr(e, "is_user_annotation", False) for e in device):  # RUN_SCOPE's, at least
        return [e for e in device if not e.is_user_annotation]
    cpu_names = {e.name for e in events if not _on_device(e)}  # a profiler without the flag
    return [e for e in device if e.name not in cpu_names]


def _print_graph_census(run: Any, tokens: int) -> None:
    """CUDA-graph replays per output token of a request (a run of 1 + N tokens minus a run of
    1, over N), by the function outside torch that called ``CUDAGraph.replay``: which graphs a
    step launches (the target's, the drafter's, our small launches) and how many of each."""
    import collections

    import torch

    counts: collections.Counter[str] = collections.Counter()
    replay = torch.cuda.CUDAGraph.replay

    def counted(graph: Any) -> Any:
        frame = sys._getframe(1)
        while frame is not None and "/torch/" in frame.f_code.co_filename:
            frame = frame.f_back
        where = "?" if frame is None else frame.f_code.co_filename.rsplit("/", 3)[-3:]
        name = "?" if frame is None else frame.f_code.co_name
        counts["/".join(where) + f":{name}"] += 1
        return replay(graph)

    def census(n: int) -> collections.Counter[str]:
        counts.clear()
        torch.cuda.CUDAGraph.replay = counted  # type: ignore[method-assign]
        try:
            run(n)
        finally:
            torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
        return collections.Counter(counts)

    base, full = census(1), census(1 + tokens)
    print("CUDA-graph replays per output token, by caller:")
    for where in sorted(full, key=lambda w: -(full[w] - base[w])):
        print(f"  {(full[where] - base[where]) / tokens:6.2f}  {where}")


def _print_python_profile(run: Any, tokens: int, rows: int) -> None:
    """cProfile of a run of 1 + N tokens minus a run of 1, over N: per output token of a
    request, the Python functions (vLLM's, ours, torch's wrappers) with the most own time and
    the most cumulative time. Shows which host code a variant adds or saves, step for step."""
    import cProfile

    def profiled(n: int) -> dict[cprofile_rows.Function, cprofile_rows.Row]:
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            run(n)
        finally:
            profiler.disable()
        return cprofile_rows.by_function(profiler)

    base, full = profiled(1), profiled(1 + tokens)
    per_token = cprofile_rows.difference(full, base, over=tokens)
    for column, what in ((1, "own"), (2, "cumulative")):
        print(f"Python functions by {what} time per output token (cProfile slows every call):")
        for func, (calls, own, cumulative) in cprofile_rows.ranked(per_token, column, rows):
            print(
                f"  {own * 1e6:8.1f} us own {cumulative * 1e6:9.1f} us cum "
                f"{calls:6.2f} calls  {cprofile_rows.label(func)}"
            )
    print(flush=True)


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


RUN_SCOPE = "profile_decode: profiled run"
SCOPES = ("gpu_model_runner:", "gemma4_spec:", "profile_decode:")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def _print_step_summary(per_step: dict[str, tuple[float, ...]]) -> None:
    """Per decode step: the runner's and our scopes (CPU time inside each), GPU busy time, and
    the launches and host syncs the CPU made."""
    print("\nper output token of a request (profiled; the profiler slows the CPU side):")
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


def _print_gpu_idle(events: Any, rows: int, tokens: int) -> None:
    """Where the GPU waits on the host during the decode steps: the idle gaps between device
    events (kernels, copies, memsets; graph replays show their kernels), each charged to the
    innermost runner or gemma4_spec scope the CPU was in when the gap ended (the work that
    delayed the next launch). Kineto puts CPU and GPU events on one clock."""
    cpu = [e for e in events if not _on_device(e)]
    device = sorted((e.time_range.start, e.time_range.end) for e in _device_events(events))
    forwards = sorted(e.time_range.start for e in cpu if e.name == "gpu_model_runner: forward")
    if not device:
        print("GPU idle: no device events in the profile\n")
        return
    if len(forwards) >= 3:
        start, end, steps = forwards[1], device[-1][1], len(forwards) - 1  # skip the prefill
    else:  # Model Runner V2 has no runner scopes: the whole run, per output token
        start, end, steps = device[0][0], device[-1][1], tokens
    scopes = [e for e in cpu if e.name.startswith(SCOPES) and e.name != RUN_SCOPE]
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
        f"GPU timeline over {steps} decode steps (or output tokens, without the runner's "
        f"scopes): {span / steps:.1f} us per step, "
        f"GPU busy {busy / steps:.1f} us, idle {idle / steps:.1f} us ({idle / span:.0%})"
    )
    print("GPU idle per step, by the CPU scope in which the idle gap ended:")
    for name, gap in sorted(idle_by_scope.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {name:60s} {gap / steps:9.1f} us")
    print(flush=True)


if __name__ == "__main__":
    main()
