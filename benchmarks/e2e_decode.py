"""End-to-end decode step time on a GPU: no speculation vs vLLM's in-tree gemma4_mtp vs ours.

E2B-shaped random weights (``gemma4_spec.testing.e2b_shaped``), bf16, CUDA graphs, greedy,
128-token random prompts, 128 new tokens, batch sizes and k as given. Random weights accept
(almost) no drafts, so every step yields one token per sequence and the ratio of a speculative
step to a plain step is the pure cost of speculating; it must stay small for speculation to pay
off with a real assistant. Every configuration is its own engine process (``VLLM_PLUGINS`` picks
ours or the in-tree one); they start together, then are timed in rounds, taking turns. Each
engine also reports its process CPU time and garbage-collection pauses per step: a CPU time
close to the step time means the host bounds the step. With ``--scopes``, each engine also times
the host's scopes of a step (``host_scopes.py``: engine, scheduler, runner, proposer).

    python benchmarks/e2e_decode.py --workdir /tmp/e2b --batch 1,8,32 --k 2,4 --json e2e.json
    python benchmarks/e2e_decode.py --workdir /tmp/e2b --batch 1,8 --k 2 --scopes \
        --only "plain (V1),ours k=2 (V1)"
    python benchmarks/e2e_decode.py --table e2e.json   # the tables of a saved run, again
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from engine_turns import EngineTurns, engine_env, turn_done, wait_turn, worker_ready  # noqa: E402

PROMPT_LEN = 128
NEW_TOKENS = 128
ROUNDS = 5  # default; --rounds
ENGINE = dict(
    dtype="bfloat16",
    skip_tokenizer_init=True,
    max_model_len=512,
    max_num_seqs=32,
    enable_prefix_caching=False,
    kv_cache_memory_bytes=4 << 30,
    gpu_memory_utilization=0.2,  # the start-up free-memory check; engines run side by side
    attention_config={"backend": "TRITON_ATTN"},
    disable_log_stats=False,
)


def engine_kwargs(workdir: str, spec_tokens: int) -> dict[str, Any]:
    """``LLM(...)`` arguments for the pair in ``workdir``: plain decoding for 0 speculative
    tokens, gemma4_mtp with that many otherwise."""
    kwargs: dict[str, Any] = dict(ENGINE, model=str(Path(workdir) / "target"))
    if spec_tokens:
        kwargs["speculative_config"] = {
            "method": "gemma4_mtp",
            "model": str(Path(workdir) / "assistant"),
            "num_speculative_tokens": spec_tokens,
        }
    return kwargs


def configurations(ks: list[int], v2_experiment: bool = False) -> dict[str, dict[str, Any]]:
    """name -> environment and speculative config of one engine."""
    configs: dict[str, dict[str, Any]] = {
        "plain (V2, vLLM default)": {"env": {"VLLM_PLUGINS": "none"}, "k": 0},
        "plain (V1)": {"env": {"VLLM_PLUGINS": "none", "VLLM_USE_V2_MODEL_RUNNER": "0"}, "k": 0},
    }
    for k in ks:
        configs[f"in-tree k={k} (V2)"] = {"env": {"VLLM_PLUGINS": "none"}, "k": k}
        configs[f"ours k={k} (V1)"] = {"env": {}, "k": k}
    # A/B of ours at the first k (last, so the engines above keep their compile-cache indices):
    # with vLLM's own verification attention (patch_triton_attn off), and with vLLM's own
    # verification inputs, rejection sampler and draft start (verify_metadata, verify_input_ids,
    # patch_rejection_sampler and draft_start off). GEMMA4_SPEC_GRAPHED_LAUNCHES=0 (per-step
    # kernels launched as they are) made no difference beyond the noise at 56be685; not run.
    configs[f"ours k={ks[0]} (V1, vLLM verify attn)"] = {
        "env": {"GEMMA4_SPEC_FLAT_VERIFY": "0"},
        "k": ks[0],
    }
    configs[f"ours k={ks[0]} (V1, vLLM sampler+inputs)"] = {
        "env": {
            "GEMMA4_SPEC_VERIFY_METADATA": "0",
            "GEMMA4_SPEC_VERIFY_INPUT_IDS": "0",
            "GEMMA4_SPEC_GREEDY_VERIFY": "0",
            "GEMMA4_SPEC_DRAFT_START": "0",
        },
        "k": ks[0],
    }
    if v2_experiment:  # not run unless asked: an engine that fails to start stops the run
        for k in ks:
            configs[f"ours k={k} (V2)"] = {
                "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"},
                "k": k,
            }
    return configs


def _worker(args: argparse.Namespace) -> None:
    """One engine: start, say ready, wait for go, time every batch size, write results."""
    import faulthandler

    # If start-up hangs, the log shows where every thread was (the engine runs in this process).
    faulthandler.dump_traceback_later(args.start_timeout - 15, exit=False)
    from vllm import LLM, SamplingParams

    from gemma4_spec.metrics import Acceptance, spec_metrics

    control = Path(args.control)
    llm = LLM(**engine_kwargs(args.workdir, args.spec_tokens))
    if args.scopes:
        import host_scopes

        host_scopes.install()
    rng = random.Random(0)
    batches = [int(b) for b in args.batch.split(",")]
    prompts = {
        b: [{"prompt_token_ids": [rng.randrange(10, 262_000) for _ in range(PROMPT_LEN)]}
            for _ in range(b)]
        for b in batches
    }  # fmt: skip

    gc_pauses: list[float] = []  # seconds of each garbage collection while timing
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_started[0])

    def run(batch: int, tokens: int) -> tuple[float, float, float, dict[str, Any]]:
        """(wall s, process CPU s, GC pause s, host scope totals) of generating ``tokens`` per
        prompt."""
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        gc_pauses.clear()
        scopes = host_scopes.snapshot() if args.scopes else {}
        cpu = time.process_time()
        start = time.perf_counter()
        llm.generate(prompts[batch], params, use_tqdm=False)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        scopes = host_scopes.delta(scopes, host_scopes.snapshot()) if args.scopes else {}
        return wall, cpu, sum(gc_pauses), scopes

    for b in batches:  # warm-up (also captures anything captured on first use)
        run(b, 8)
    faulthandler.cancel_dump_traceback_later()
    worker_ready(control, args.index)

    # Timed in rounds, the engines taking turns within each round (the parent says when), so
    # that drift of the machine over the run spreads over every configuration alike.
    # Per decode step, besides its time: the process's CPU time (all its threads; near the
    # step time, the host bounds the step) and garbage-collection pauses.
    step_ms: dict[int, list[float]] = {b: [] for b in batches}
    cpu_ms: dict[int, list[float]] = {b: [] for b in batches}
    gc_ms: dict[int, list[float]] = {b: [] for b in batches}
    scope_ms: dict[int, list[dict[str, list[float]]]] = {b: [] for b in batches}
    before = spec_metrics(llm.get_metrics())
    gc.callbacks.append(on_gc)
    for rnd in range(args.rounds):
        wait_turn(control, args.index, rnd)
        for b in batches:
            prefill = run(b, 1)
            full = run(b, 1 + NEW_TOKENS)
            step_ms[b].append((full[0] - prefill[0]) / NEW_TOKENS * 1e3)
            cpu_ms[b].append((full[1] - prefill[1]) / NEW_TOKENS * 1e3)
            gc_ms[b].append((full[2] - prefill[2]) / NEW_TOKENS * 1e3)
            if args.scopes:
                scope_ms[b].append(host_scopes.per_step(full[3], prefill[3], NEW_TOKENS))
        turn_done(control, args.index, rnd)
    gc.callbacks.remove(on_gc)
    acc = Acceptance.between(before, spec_metrics(llm.get_metrics()))
    results = {
        str(b): {
            "step_ms": statistics.median(step_ms[b]),
            "step_ms_all": step_ms[b],
            "cpu_ms_all": cpu_ms[b],
            "gc_ms_all": gc_ms[b],
            "acceptance_rate": acc.acceptance_rate if acc.num_draft_tokens else None,
        }
        for b in batches
    }
    if args.scopes:  # median over the rounds of each scope's [calls, wall ms, CPU ms]
        for b in batches:
            results[str(b)]["scopes"] = {
                name: [statistics.median(r[name][i] for r in scope_ms[b]) for i in range(3)]
                for name in scope_ms[b][0]
            }
            results[str(b)]["scopes_all"] = scope_ms[b]  # per round, to compare slow and fast
    Path(args.out).write_text(json.dumps(results))


def _build(workdir: str) -> None:
    from gemma4_spec.testing.e2b_shaped import build_e2b_shaped_pair

    build_e2b_shaped_pair(workdir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/e2b-shaped")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--k", default="2,4")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=None, help="comma-separated name prefixes to run")
    parser.add_argument("--start-timeout", type=float, default=420)
    parser.add_argument("--scopes", action="store_true", help="time the host's scopes too")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds per engine")
    parser.add_argument("--table", default=None, help="print the tables of a saved --json, only")
    # internal: worker mode
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--spec-tokens", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--v2-experiment",
        action="store_true",
        help="also run ours on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)",
    )
    args, _ = parser.parse_known_args()
    if args.table:
        _print_table(json.loads(Path(args.table).read_text())["results"])
        return 0
    if args.build:
        _build(args.workdir)
        return 0
    if args.worker:
        _worker(args)
        return 0

    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--build", "--workdir", args.workdir], check=True)
    print(f"checkpoints ready in {time.perf_counter() - started:.0f} s", flush=True)
    configs = configurations([int(k) for k in args.k.split(",")], args.v2_experiment)
    if args.only:
        wanted = args.only.split(",")
        configs = {n: c for n, c in configs.items() if any(n.startswith(w) for w in wanted)}
    turns = EngineTurns(Path(args.workdir) / "control")
    for index, (name, config) in enumerate(configs.items()):
        turns.start(
            name,
            __file__,
            [
                "--workdir",
                args.workdir,
                "--batch",
                args.batch,
                "--spec-tokens",
                str(config["k"]),
                "--rounds",
                str(args.rounds),
                "--start-timeout",
                str(args.start_timeout),
            ]
            + ["--scopes"] * args.scopes,  # fmt: skip
            engine_env(config["env"], Path(args.workdir) / f"cache-{index}"),
        )
    turns.wait_ready(args.start_timeout)
    print(f"all engines ready after {time.perf_counter() - started:.0f} s", flush=True)
    turns.take_turns(args.rounds)
    results = turns.results()

    _print_table(results)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"new_tokens": NEW_TOKENS, "prompt_len": PROMPT_LEN, "results": results},
                       indent=2)
        )  # fmt: skip
    return 0


def _print_table(results: dict[str, Any]) -> None:
    """Each speculative run's step time, with its ratio to the plain run on the same model
    runner (the pure cost of speculating there) and to vLLM's default plain run; its spread
    over the rounds; its process CPU time; its host scopes where they were timed."""
    plain = {runner: next((n for n in results if n == f"plain ({runner}{tail}"), None)
             for runner, tail in (("V2", ", vLLM default)"), ("V1", ")"))}  # fmt: skip
    default = plain["V2"] or next(iter(results))
    batches = list(results[default])
    Cell = Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], str]

    def table(title: str, cell: Cell) -> None:
        """One row per run, one cell per batch size: ``cell(the run's figures, its same-runner
        plain run's, the default plain run's)`` at that batch size."""
        print(f"\n{title}")
        print(f"{'configuration':26}" + "".join(f"{'B=' + b:>26}" for b in batches))
        for name, per_batch in results.items():
            same = results[plain["V1" if "(V1" in name else "V2"] or default]
            cells = [cell(per_batch[b], same[b], results[default][b]) for b in batches]
            print(f"{name:26}" + "".join(f"{c:>26}" for c in cells))

    def step(run: dict[str, Any], same: dict[str, Any], base: dict[str, Any]) -> str:
        ms, acc = run["step_ms"], run["acceptance_rate"]
        ratios = f"{ms / same['step_ms']:4.2f}x/{ms / base['step_ms']:4.2f}x"
        return f"{ms:6.3f} {ratios}" + (f" a={acc:.2f}" if acc is not None else "")

    def spread(run: dict[str, Any], same: dict[str, Any], _: dict[str, Any]) -> str:
        rounds = run["step_ms_all"]
        best = min(rounds) / min(same["step_ms_all"])
        return f"{min(rounds):6.3f} - {max(rounds):6.3f} ({best:4.2f}x)"

    def paired(run: dict[str, Any], same: dict[str, Any], _: dict[str, Any]) -> str:
        pairs = zip(run["step_ms_all"], same["step_ms_all"], strict=True)
        ratios = [ms / base for ms, base in pairs]
        return f"{statistics.median(ratios):4.2f}x ({min(ratios):4.2f} - {max(ratios):4.2f})"

    def host(run: dict[str, Any], _: dict[str, Any], __: dict[str, Any]) -> str:
        cpu, gc_ms = statistics.median(run["cpu_ms_all"]), statistics.median(run["gc_ms_all"])
        return f"{cpu:6.3f} / {gc_ms:6.3f}"

    table(f"decode step time, ms (x same-runner plain / x '{default}'); acceptance a", step)
    # The host's speed drifts between rounds (at d947542 every host scope of a slow round grew,
    # plain V1's too), so a ratio of medians taken over different rounds mixes that drift in;
    # the paired table divides each round by the plain run's round just before or after it
    # (the engines take turns within a round).
    table("per round, ms: fastest - slowest (fastest x same-runner plain's fastest)", spread)
    table("per round, x same-runner plain in the same round: median (lowest - highest)", paired)
    if all("cpu_ms_all" in results[n][b] for n in results for b in batches):
        table("per step, ms, median of the rounds: process CPU time / garbage-collection pauses",
              host)  # fmt: skip
    for name, per_batch in results.items():
        if "scopes" in per_batch[batches[0]]:
            _print_scopes(name, per_batch, batches)


def _print_round_spread(name: str, per_batch: dict[str, Any], batches: list[str]) -> None:
    """Where one engine's slowest round spent its extra time over its fastest: the scopes whose
    wall time per step differs most between the two rounds (the two outermost left out: they
    hold everything)."""
    from host_scopes import largest_differences

    print(f"\n{name}: slowest minus fastest round, ms per step, largest scope differences")
    for b in batches:
        rounds, per_round = per_batch[b]["step_ms_all"], per_batch[b].get("scopes_all")
        if not per_round:
            continue
        fast, slow = rounds.index(min(rounds)), rounds.index(max(rounds))
        cells = largest_differences(per_round[slow], per_round[fast], 6)
        print(f"  B={b}: step {rounds[slow] - rounds[fast]:+.3f}: {cells}")


def _print_scopes(name: str, per_batch: dict[str, Any], batches: list[str]) -> None:
    """One engine's host scopes per decode step (``host_scopes.py``), indented by nesting."""
    from host_scopes import print_table

    print_table(name, {b: per_batch[b]["scopes"] for b in batches}, batches)
    _print_round_spread(name, per_batch, batches)


if __name__ == "__main__":
    sys.exit(main())
