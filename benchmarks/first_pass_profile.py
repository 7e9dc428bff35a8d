"""Where the first pass at a new batch size spends its time: one engine of ``real_work.py``'s
configurations, in this process, warmed at batch 1 (unless ``--cold``: then the first batch
size's first pass is the engine's very first request), then the first and the second pass at
each batch size under cProfile (the host's view: compiles, captures, synchronisations show as
Python calls). For each batch size it lists the functions whose time grew most from the second
pass to the first (what the first pass does more of), and the CUDA caching allocator's device
allocations and frees in each pass (``cudaMalloc`` / ``cudaFree`` where the pool lacks a block),
and the time the garbage collector ran in it (cProfile charges that to whatever allocated).

    python benchmarks/first_pass_profile.py --variant ours-V1 --batch 8,16
    python benchmarks/first_pass_profile.py --variant ours-V2 --pair e2b --batch 1,8 --cold
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import cprofile_rows  # noqa: E402
import real_work  # noqa: E402
from lazy_work import GcPauses, allocator_counts  # noqa: E402

from gemma4_spec.testing.engine_run import watch_triton_compiles  # noqa: E402


class TritonCompiles:
    """Every Triton JIT compilation in this process (Triton's ``jit_cache_hook``, called before
    a kernel is compiled for a specialisation not yet in memory), by phase: which kernel a pass
    compiles, and the specialisations the start-up compiled for the same kernel, to compare."""

    def __init__(self) -> None:
        self.phase = "start-up"
        self.seen: list[tuple[str, str]] = []  # (phase, "name[options](arguments)")

    def install(self) -> bool:
        try:
            watch_triton_compiles(lambda kernel: self.seen.append((self.phase, kernel)))
        except ImportError:
            return False
        return True

    def report(self, phase: str) -> None:
        compiled = [text for when, text in self.seen if when == phase]
        print(f"Triton compilations in {phase}: {len(compiled)}")
        for text in compiled:
            name = text.split("[", 1)[0]
            print(f"  {text}")
            for when, earlier in self.seen:
                if when == "start-up" and earlier.split("[", 1)[0] == name:
                    print(f"    at start-up: {earlier}")


def print_growth(first: cProfile.Profile, second: cProfile.Profile, top: int) -> None:
    """The functions whose own time (then cumulative time) grew most from the second pass to the
    first, with their call counts in both."""
    a, b = cprofile_rows.by_function(first), cprofile_rows.by_function(second)
    grown = cprofile_rows.difference(a, b)
    for column, label in ((1, "own"), (2, "cumulative")):
        print(f"first pass minus second, {label} time (ms; calls first / second):")
        for func, row in cprofile_rows.ranked(grown, column, top):
            calls = b.get(func, cprofile_rows.NONE)[0]
            print(
                f"  {row[column] * 1e3:8.2f}  {a[func][0]:6.0f} / {calls:<6.0f} "
                f"{cprofile_rows.label(func)}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=real_work.PAIRS, default="trained")
    parser.add_argument(
        "--variant",
        default="ours-V1",
        type=real_work.engine_variant,
        help=real_work.ENGINE_VARIANTS_HELP,
    )
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch", default="8,16")
    parser.add_argument("--workdir", default="/tmp/real")
    parser.add_argument("--top", type=int, default=25)
    real_work.add_acceptance_option(parser)
    parser.add_argument("--cold", action="store_true", help="no warm-up request at batch 1")
    parser.add_argument(
        "--callees",
        default=None,
        help="also list, for both passes, what functions matching this regex call "
        "(e.g. 'patch_triton_attn.py.*build')",
    )
    parser.add_argument(
        "--triton-compiles",
        action="store_true",
        help="list every Triton compilation of each pass beside the start-up's of that kernel",
    )
    args = parser.parse_args()
    compiles = TritonCompiles()
    if args.triton_compiles and not compiles.install():
        parser.error("--triton-compiles needs Triton")

    llm, target = real_work.start_profiled(parser, args)
    from vllm import SamplingParams

    batches = [int(b) for b in args.batch.split(",")]
    prompts = real_work._prompts(args.pair, target, max(batches))
    params = SamplingParams(
        max_tokens=real_work.NEW_TOKENS,
        temperature=0.0,
        ignore_eos=args.pair in real_work.RANDOM_PAIRS,
    )
    compiles.phase = "warm-up requests"
    for _ in range(0 if args.cold else 2):
        llm.generate(prompts[:1], params, use_tqdm=False)
    pauses = GcPauses()
    for b in batches:
        profiles: list[cProfile.Profile] = []
        for which in ("first", "second"):
            profile = cProfile.Profile()
            profiles.append(profile)
            compiles.phase = f"B={b} {which} pass"
            before = allocator_counts()
            pauses.reset()
            start = time.perf_counter()
            profile.enable()
            llm.generate(prompts[:b], params, use_tqdm=False)
            profile.disable()
            wall = time.perf_counter() - start
            done = {k: v - before[k] for k, v in allocator_counts().items()}
            print(
                f"\n=== B={b} {which} pass: {wall:.3f} s; device allocations "
                f"{done['device_allocs']} ({done['device_alloc_bytes'] / 2**20:.0f} MiB), "
                f"frees {done['device_frees']}, allocator retries {done['alloc_retries']} "
                f"(in this process); garbage collection {pauses}"
            )
            if args.triton_compiles:
                compiles.report(compiles.phase)
            if args.callees:
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("cumulative").print_callees(
                    args.callees
                )
                print(out.getvalue()[-6000:])
            if which == "first":
                out = io.StringIO()
                stats = pstats.Stats(profile, stream=out).sort_stats("cumulative")
                stats.print_stats(args.top)
                print(out.getvalue()[-6000:])
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
                print(out.getvalue()[-3000:])
        print_growth(profiles[0], profiles[1], args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
