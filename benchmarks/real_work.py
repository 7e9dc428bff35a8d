"""Tokens/s of real work on a GPU: plain decoding vs vLLM's in-tree gemma4_mtp vs ours.

What a user feels, side by side in one run: every configuration is its own engine process
(``VLLM_PLUGINS`` picks ours or the in-tree one; each on the model runner it picks by default,
and ours also on Model Runner V2), started together, then timed in rounds, each batch size of
a round in turn from engine to engine (in reverse order every other round). Round 0 is the
**first pass** at each batch size, right
after start-up with no warm-up (anything captured or compiled lazily shows there); the later
rounds are the steady state.

Pairs and acceptance profiles:

* ``e2b``: E2B-shaped random weights (``gemma4_spec.testing.e2b_shaped``), bf16, 128-token
  random prompts (``--prompt-len``: longer ones, past the 512-token sliding window, for the
  verification attention's long-context side), 128 new tokens each (``ignore_eos``). Random
  weights accept nothing, so the acceptance comes from vLLM's synthetic rejection sampling
  (``rejection_sample_method: "synthetic"``, unconditional per-position rates): ``field``
  [0.85, 0.70, 0.55], ``poor`` [0.5, 0.25, 0.1]; ``zero`` is standard verification (nothing
  accepted: every step alike).
* ``e4b``, ``26b-a4b``, ``31b``: the published shapes of those pairs with random bf16 weights
  (``gemma4_spec.testing.families.build_real_shape_pair``), run like ``e2b``. The 26B-A4B and
  31B targets are written as configs only and their engines draw the weights themselves
  (``load_format="dummy"``): their checkpoints (~52 and ~62 GB) would not fit the GPU machine's
  disk. Each engine holds the whole target (E4B ~16 GB, 26B-A4B ~52 GB, 31B ~62 GB): pick the
  engines that fit one GPU with ``--variants`` and ``--only`` (without plain, the tables show
  ours against in-tree only).
* ``trained``: the shipped GSM8k-trained tiny pair (``gemma4_spec.assets``), bf16, GSM8k test
  questions in its chat template, up to 128 new tokens: real acceptance, requests that finish
  at different steps, so the batch shrinks as it would in serving (profile ``real``).

Greedy requests by default; ``--temperature`` samples instead (every engine alike), and
``--draft-method probabilistic`` has the speculative engines draft by sampling (vLLM's
``draft_sample_method``). Per (configuration, batch size, round): wall time, tokens, tokens/s,
time per output token of a request, and the mean accepted length from vLLM's counters. A steady
round's cell runs its batch again until ``--min-seconds`` (1 s) have passed, the first pass once.

    python benchmarks/real_work.py --pair e2b --profiles field,poor,zero --k 3 --json e2b.json
    python benchmarks/real_work.py --pair trained --k 2,3 --json trained.json
    python benchmarks/real_work.py --pair trained --k 3 --temperature 1.0 \
        --draft-method probabilistic --json trained-t1.json
    python benchmarks/real_work.py --pair e2b --profiles field --k 3 --batch 8,32 \
        --prompt-len 2048 --json e2b-long.json
    python benchmarks/real_work.py --table e2b.json   # the tables of a saved run, again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import lzma
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import host_probe  # noqa: E402
import lazy_work  # noqa: E402
from engine_turns import (  # noqa: E402
    CORE_IN_PROCESS_ENV,
    EngineTurns,
    engine_env,
    process_tree,
    turn_done,
    wait_turn,
    worker_ready,
)

PROFILES = {"field": [0.85, 0.70, 0.55], "poor": [0.5, 0.25, 0.1]}
REAL, ZERO = "real", "zero"  # the trained pair's own acceptance; standard verification
PROMPT_LEN = 128
NEW_TOKENS = 128
ENGINE: dict[str, Any] = dict(
    dtype="bfloat16",
    max_model_len=1024,
    max_num_seqs=64,
    enable_prefix_caching=False,
    kv_cache_memory_bytes=1 << 30,  # skips memory profiling: engines start side by side
    gpu_memory_utilization=0.1,  # the start-up free-memory check
    attention_config={"backend": "TRITON_ATTN"},
    disable_log_stats=False,
)
PLAIN_ENV = {"VLLM_PLUGINS": "none"}  # plain decoding: vLLM alone


def _on_v2(spec: dict[str, Any] | None = None, **env: str) -> dict[str, Any]:
    """Ours on Model Runner V2 with the plugin settings ``env`` and speculative-config
    additions ``spec``."""
    return {"env": {"VLLM_USE_V2_MODEL_RUNNER": "1", **env}, "spec": spec or {}}


def _attention_form(own_split: str, segments: int | None = None) -> dict[str, Any]:
    """Ours on V2 with one verification-attention form: ``GEMMA4_SPEC_OWN_SPLIT_ATTENTION``,
    and ``GEMMA4_SPEC_VERIFY_SEGMENTS`` where ``segments`` is given."""
    if segments is None:
        return _on_v2(GEMMA4_SPEC_OWN_SPLIT_ATTENTION=own_split)
    return _on_v2(
        GEMMA4_SPEC_OWN_SPLIT_ATTENTION=own_split, GEMMA4_SPEC_VERIFY_SEGMENTS=str(segments)
    )


# How each speculative engine runs: its environment and speculative-config additions.
VARIANTS: dict[str, dict[str, Any]] = {
    "in-tree": {"env": PLAIN_ENV, "spec": {}},
    # Ours on each runner: our proposer on V1; on V2 our draft loop (spec_decode/runner_v2.py)
    # with our model and centroid argmax. With VLLM_USE_V2_MODEL_RUNNER unset ours runs on
    # the plugin's default.
    "ours-V1": {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "spec": {}},
    "ours-V2": _on_v2(),
    # Ours on V1 without its V1-only host shortcuts (vLLM's own verification index arrays,
    # carried-token writes and draft-start methods; Triton launches and draft sampling not
    # replayed from graphs), the whole-loop draft graph kept: what those shortcuts earn on
    # real work, where they have only been measured with nothing accepted.
    "ours-V1-vllmhost": {
        "env": {
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "GEMMA4_SPEC_VERIFY_METADATA": "0",
            "GEMMA4_SPEC_VERIFY_INPUT_IDS": "0",
            "GEMMA4_SPEC_DRAFT_START": "0",
            "GEMMA4_SPEC_GRAPHED_LAUNCHES": "0",
            "GEMMA4_SPEC_SAMPLER_GRAPHS": "0",
        },
        "spec": {},
    },
    # Diagnostic, not run unless named in --variants: ours on V2 without the split-key
    # verification attention (patch/patch_triton_attn.py), to measure what it earns in one run.
    "ours-V2-noflat": _on_v2(GEMMA4_SPEC_FLAT_VERIFY="0"),
    # The split-key verification attention up to 32 query tokens (its default before
    # GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS became 128): what the larger verification batches
    # (k=3 at B = 16 / 32, k=2 at B = 32) gain on the split kernel.
    "ours-V2-split32": _on_v2(GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS="32"),
    # The verification attention before the large-batch default (patch/patch_triton_attn.py):
    # vLLM's split kernel at its 16 segments for every verification batch, ours never.
    "ours-V2-vllm16": _attention_form("0", 16),
    # The split-key verification with fewer softmax segments than vLLM's 16 at every batch
    # size (GEMMA4_SPEC_VERIFY_SEGMENTS): less scratch written and reduced per query token.
    "ours-V2-seg8": _attention_form("0", 8),
    # Verification attention through our split kernel (ops/split_attention_triton.py) for
    # every verification batch (GEMMA4_SPEC_OWN_SPLIT_ATTENTION=1): segments over the attended
    # keys, their count from the key count, one launch a layer.
    "ours-V2-ownsplit": _attention_form("1"),
    # Our split kernel for the sliding-window layers of every verification batch (it lost to
    # vLLM's on the full ones in one layer's timings), and the same with vLLM's at 8 or 4
    # segments for the full layers (the default's large-batch form, at every size).
    "ours-V2-ownsliding": _attention_form("sliding"),
    "ours-V2-ownsliding-seg8": _attention_form("sliding", 8),
    "ours-V2-ownsliding-seg4": _attention_form("sliding", 4),
    "ours-V2-seg4": _attention_form("0", 4),
    # The draft's attention on our split kernel (GEMMA4_SPEC_OWN_DRAFT_ATTENTION): one launch a
    # draft layer where vLLM's split kernel takes two, segments from the keys attended.
    "ours-V2-owndraft": _on_v2(GEMMA4_SPEC_OWN_DRAFT_ATTENTION="1"),
    "ours-V2-owndraft-sliding": _on_v2(GEMMA4_SPEC_OWN_DRAFT_ATTENTION="sliding"),
    # vLLM's own V2 speculator (its draft prefill and step graphs) drafting with our model:
    # what our V2 draft loop (patch/patch_v2_speculator.py) earns.
    "ours-V2-vllmloop": _on_v2(GEMMA4_SPEC_V2_DRAFT_LOOP="0"),
    # V2's own rejection sampling for greedy batches (patch/patch_v2_rejection_sampler.py
    # off): what our greedy verification earns (with synthetic acceptance too, which it draws
    # as V2 does).
    "ours-V2-vllmverify": _on_v2(GEMMA4_SPEC_GREEDY_VERIFY="0"),
    # vLLM's dynamic speculation length (num_speculative_tokens_per_batch_size; capped at the
    # run's k): fewer drafts where the batch is large and verifying them costs more than they
    # earn at poor acceptance. Diagnostic: whether a schedule by batch size gives the
    # GPU-bound rows what a fixed k cannot.
    "ours-V2-dynk": _on_v2(
        spec={"num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 32, 2], [33, 1024, 1]]}
    ),
    # The assistant's projections through cuBLAS (F.linear) instead of our small-rows kernel
    # (ops/small_linear.py, GEMMA4_SPEC_SMALL_LINEAR=0): what the kernel earns in one run.
    "ours-V2-cublas": _on_v2(GEMMA4_SPEC_SMALL_LINEAR="0"),
    # Ours' greedy verification as it ran before 227381e: vLLM's soft-capped logits, verified
    # eagerly (GEMMA4_SPEC_UNCAPPED_VERIFY=0, GEMMA4_SPEC_GRAPHED_VERIFY=0); in 971a10f / 79128f0
    # runs named "ours-V2" (the uncapped one was "ours-V2-uncapped").
    "ours-V2-capped": _on_v2(GEMMA4_SPEC_UNCAPPED_VERIFY="0", GEMMA4_SPEC_GRAPHED_VERIFY="0"),
    # The verification from uncapped logits, launched eagerly (no start-up graphs,
    # spec_decode/verify_graphs.py); in 5009256's run named "ours-V2-uncapped".
    "ours-V2-eagerverify": _on_v2(GEMMA4_SPEC_GRAPHED_VERIFY="0"),
    # vLLM's own allocate_slots for every request a step (patch/patch_allocate_slots.py off):
    # what the decode-step short cut earns in one run.
    "ours-V2-vllmalloc": _on_v2(GEMMA4_SPEC_FAST_ALLOCATE="0"),
    # Without the start-up upload of the runner's CUDA graphs (spec_decode/graph_upload.py):
    # what it changes in a first pass at each batch size.
    "ours-V2-noupload": _on_v2(GEMMA4_SPEC_GRAPH_UPLOAD="0"),
    # Without the start-up compilation of small prefill batches (patch/patch_v2_warmup.py):
    # what it changes in a first pass.
    "ours-V2-nowarm": _on_v2(GEMMA4_SPEC_PREFILL_WARMUP="0"),
}
DEFAULT_VARIANTS = ("in-tree", "ours-V1", "ours-V2")
# Settings a variant can add to ours-V2 by name, "ours-V2+sizes=m128_w4+large=48": the plugin
# setting (or, marked, the torch setting) each short name stands for.
SETTINGS = {
    "sizes": "GEMMA4_SPEC_SPLIT_ATTENTION_SIZES",
    "large": "GEMMA4_SPEC_LARGE_VERIFY_TOKENS",
    "own": "GEMMA4_SPEC_OWN_SPLIT_ATTENTION",
    "draft": "GEMMA4_SPEC_OWN_DRAFT_ATTENTION",
    "gelu": "GEMMA4_SPEC_FUSED_GELU",
    "qrope": "GEMMA4_SPEC_FUSED_QROPE",
    "segments": "GEMMA4_SPEC_VERIFY_SEGMENTS",
    "target": "GEMMA4_SPEC_TARGET_LINEAR",  # "ours-V2+target=1": the target's matmuls on ours
    # torch: one reduction configuration chosen by Inductor's rule, none timed at run time
    # (for the target compile range's norms, whose speed differed between processes).
    "rfilter": "TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS",
}


def variant(name: str) -> dict[str, Any]:
    """A variant's {env, spec}: one of ``VARIANTS``, or ``ours-V2+<setting>=<value>...`` (the
    settings' short names in ``SETTINGS``), ours-V2 with those plugin settings."""
    if name in VARIANTS:
        return VARIANTS[name]
    base, *settings = name.split("+")
    pairs = [setting.partition("=") for setting in settings]
    if base != "ours-V2" or not pairs or any(k not in SETTINGS or not v for k, _, v in pairs):
        raise SystemExit(
            f"unknown variant {name!r}: one of {list(VARIANTS)}, or ours-V2+<setting>=<value> "
            f"with settings of {list(SETTINGS)}"
        )
    return _on_v2(**{SETTINGS[k]: v for k, _, v in pairs})


def engine_variant(name: str) -> str:
    """``name`` if the profilers can start it: ``plain`` (drafting nothing) or a ``variant``;
    else exits naming the variants it knows. An argparse ``type``."""
    if name != "plain":
        variant(name)
    return name


ENGINE_VARIANTS_HELP = f"plain, one of {list(VARIANTS)} or ours-V2+<setting>=<value>"


def acceptance_spec(profile: str, k: int) -> dict[str, Any]:
    """The speculative-config additions of an acceptance profile: vLLM's synthetic acceptance
    at the profile's first ``k`` rates, or nothing (``zero``, ``real``: standard verification)."""
    if profile not in PROFILES:
        return {}
    return {
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": PROFILES[profile][:k],
    }


def configurations(
    ks: list[int], profiles: list[str], variants: list[str], draft_method: str = "greedy"
) -> dict[str, dict[str, Any]]:
    """name -> {env, k, spec (speculative-config additions)} of one engine."""
    configs: dict[str, dict[str, Any]] = {"plain": {"env": PLAIN_ENV, "k": 0}}
    for profile in profiles:
        for k in ks:
            spec = acceptance_spec(profile, k)
            if draft_method != "greedy":
                spec["draft_sample_method"] = draft_method
            for name in variants:
                chosen = variant(name)
                configs[f"{name} k={k} {profile}"] = {
                    "env": chosen["env"],
                    "k": k,
                    "spec": {**spec, **chosen["spec"]},
                }
    return configs


ENGINE_CORES = ("in-process", "own-process")
BOTH_CORES = "both"
OWN_CORE = "own-core"  # the name suffix of an engine run both ways, in its own-process form


def with_engine_cores(configs: dict[str, dict[str, Any]], mode: str) -> dict[str, dict[str, Any]]:
    """``configs`` with where each engine core runs (``core_in_process``): all alike, or with
    ``both`` each engine twice, in process and (named ``<name> own-core``) in its own, so the
    two modes compare in one run. An own-core engine pairs with the own-core in-tree one."""
    if mode != BOTH_CORES:
        return {n: {**c, "core_in_process": mode == "in-process"} for n, c in configs.items()}
    both: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        both[name] = {**config, "core_in_process": True}
        both[f"{name} {OWN_CORE}"] = {**config, "core_in_process": False}
    return both


# Pairs of random weights: synthetic acceptance, random prompts, no tokenizer, no end token.
RANDOM_PAIRS = ("e2b", "e4b", "26b-a4b", "31b")
CONFIG_ONLY_TARGETS = ("26b-a4b", "31b")  # weights drawn by the engine (load_format "dummy")
PAIRS = (*RANDOM_PAIRS, "trained")


def _pair(pair: str, workdir: Path) -> tuple[Path, Path]:
    if pair == "e2b":
        from gemma4_spec.testing.e2b_shaped import build_e2b_shaped_pair

        return build_e2b_shaped_pair(workdir / "e2b")
    if pair in RANDOM_PAIRS:
        from gemma4_spec.testing.families import build_real_shape_pair

        return build_real_shape_pair(
            pair, workdir / pair, target_weights=pair not in CONFIG_ONLY_TARGETS
        )
    from gemma4_spec.assets import tiny_gsm8k_pair

    return tiny_gsm8k_pair()


def engine_kwargs(
    pair: str,
    target: Path,
    assistant: Path,
    k: int,
    spec: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``LLM(...)`` arguments of one engine on ``pair``: ``ENGINE`` with ``overrides`` over it
    (a None value drops the argument), and gemma4_mtp with ``k`` drafts and ``spec``'s additions
    when ``k`` > 0 (plain decoding otherwise)."""
    kwargs = {
        key: value
        for key, value in dict(ENGINE, model=str(target), **(overrides or {})).items()
        if value is not None
    }
    kwargs["skip_tokenizer_init"] = pair in RANDOM_PAIRS
    if pair in CONFIG_ONLY_TARGETS:
        kwargs["load_format"] = "dummy"
    if k:
        kwargs["speculative_config"] = {
            "method": "gemma4_mtp",
            "model": str(assistant),
            "num_speculative_tokens": k,
            **(spec or {}),
        }
    return kwargs


def kv_bytes_per_token(target: Path) -> int:
    """An upper bound of the target's KV cache bytes per token (bf16): K and V of every layer
    that keeps its own (KV-shared layers read another's), sliding layers counted whole (more
    than they keep once a sequence outgrows the window)."""
    from gemma4_spec.validation import layer_attention_shape

    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    own = text["num_hidden_layers"] - text.get("num_kv_shared_layers", 0)
    shapes = [layer_attention_shape(text, layer) for layer in range(own)]
    return sum(2 * heads * dim * 2 for heads, dim in shapes)


def request_tokens(k: int, prompt_len: int = PROMPT_LEN) -> int:
    """The most tokens a request holds in the KV cache: its prompt, its new tokens and a
    verification step's ``k`` drafts and bonus token."""
    return prompt_len + NEW_TOKENS + k + 1


def kv_cache_bytes(target: Path, max_batch: int, k: int, prompt_len: int = PROMPT_LEN) -> int:
    """What one engine's KV cache is given: ``ENGINE``'s, or more where the largest batch of
    requests (``request_tokens``) would not fit it, with a quarter to spare for block
    rounding; too small a cache queues requests, and the batch measured is not ``B``."""
    need = max_batch * request_tokens(k, prompt_len) * kv_bytes_per_token(target)
    return max(ENGINE["kv_cache_memory_bytes"], need * 5 // 4)


def model_len(k: int, prompt_len: int = PROMPT_LEN) -> dict[str, Any]:
    """``max_model_len`` over ``ENGINE``'s where a request (``request_tokens``) needs more, in
    whole 256-token steps; nothing where it fits."""
    need = request_tokens(k, prompt_len)
    if need <= ENGINE["max_model_len"]:
        return {}
    return {"max_model_len": -(-need // 256) * 256}


def kv_capacity_requests(llm: Any, tokens: int) -> float | None:
    """How many requests of ``tokens`` tokens the engine's KV cache holds at once (vLLM's
    in-process engine core; None where its internals differ): every cache group gives each
    request its own blocks from one shared pool."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        config, block = scheduler.kv_cache_config, scheduler.block_size
        groups = max(1, len(config.kv_cache_groups))
        return config.num_blocks / (groups * -(-tokens // block))
    except AttributeError:
        return None


def enter_variant(name: str) -> dict[str, Any]:
    """Put this process in variant ``name``'s environment (``plain`` or a ``variant``), with the
    engine core in this process (where a profiler sees it); returns its speculative-config
    additions. Before anything imports vLLM."""
    chosen = {"env": PLAIN_ENV, "spec": {}} if name == "plain" else variant(name)
    os.environ.update(chosen["env"])
    os.environ.setdefault(CORE_IN_PROCESS_ENV, "0")
    return chosen["spec"]


def start_in_process(
    pair: str, variant: str, k: int, workdir: Path, profile: str = ZERO
) -> tuple[Any, Path]:
    """An engine of ``variant`` with ``k`` drafts (none for plain) on ``pair``, in this process
    (``enter_variant``), verifying at acceptance ``profile``: the ``LLM`` and the target's
    path."""
    spec = {**acceptance_spec(profile, k), **enter_variant(variant)}
    from vllm import LLM

    target, assistant = _pair(pair, workdir)
    k = 0 if variant == "plain" else k
    return LLM(**engine_kwargs(pair, target, assistant, k, spec)), target


def add_acceptance_option(parser: argparse.ArgumentParser) -> None:
    """The profilers' ``--acceptance`` (``start_profiled`` reads it)."""
    parser.add_argument(
        "--acceptance",
        choices=(ZERO, *PROFILES),
        default=ZERO,
        help="random pairs: standard verification (nothing accepted) or a synthetic profile",
    )


def start_profiled(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Any, Path]:
    """A profiler's engine (``start_in_process``) from its ``--pair``, ``--variant``, ``--k``,
    ``--workdir`` and ``--acceptance``; a synthetic profile on the trained pair is refused
    first."""
    if args.acceptance != ZERO and args.pair not in RANDOM_PAIRS:
        parser.error("--acceptance is for the random pairs (the trained pair accepts its own)")
    return start_in_process(args.pair, args.variant, args.k, Path(args.workdir), args.acceptance)


def _prompts(
    pair: str, target: Path, count: int, prompt_len: int = PROMPT_LEN
) -> list[dict[str, Any]]:
    """``count`` requests' prompts: random tokens, ``prompt_len`` a request, on the random
    pairs; GSM8k questions in the chat template on the trained one."""
    if pair in RANDOM_PAIRS:
        rng = random.Random(0)
        return [
            {"prompt_token_ids": [rng.randrange(10, 262_000) for _ in range(prompt_len)]}
            for _ in range(count)
        ]
    from gemma4_spec.report import chat_prompts, gsm8k_questions

    return [{"prompt_token_ids": ids} for ids in chat_prompts(str(target), gsm8k_questions(count))]


def core_shares(cores: list[int], engines: int) -> list[list[int]]:
    """``cores`` split into ``engines`` contiguous shares as even as they go (the first shares
    one larger where they do not divide); each engine gets at least one core."""
    if engines > len(cores):
        raise SystemExit(f"--pin-cores: {engines} engines but only {len(cores)} cores")
    size, extra = divmod(len(cores), engines)
    shares, start = [], 0
    for i in range(engines):
        end = start + size + (1 if i < extra else 0)
        shares.append(cores[start:end])
        start = end
    return shares


def move_threads(cores: set[int]) -> int:
    """Put every thread of this process and of the processes it started on ``cores``; returns
    how many threads moved. (``os.sched_setaffinity(0, ...)`` moves the calling thread only.)"""
    moved = 0
    for pid in process_tree(os.getpid()):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(int(task.name), cores)
                moved += 1
    return moved


def measure_cores(cores: list[int], count: int) -> list[int]:
    """The ``count`` cores every engine is measured on: the last of ``cores`` (an engine's
    threads and the GPU's driver threads start on the first ones)."""
    if not 0 < count <= len(cores):
        raise SystemExit(f"--measure-cores: {count} of {len(cores)} cores")
    return cores[-count:]


STEP_SCOPE = "scheduler:Scheduler.update_from_output"  # called once an engine step


def scopes_per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[float]]:
    """Each host scope's [calls, wall ms, thread-CPU ms] per engine step between two of
    ``host_scopes``' snapshots (steps: the scheduler's output updates)."""
    import host_scopes

    steps = after.get(STEP_SCOPE, (0,))[0] - before.get(STEP_SCOPE, (0,))[0]
    return host_scopes.per_step(after, before, max(steps, 1))


def request_timing(outputs: list[Any], accepted_length: float | None) -> dict[str, float]:
    """What a cell's requests saw (vLLM's request stats, with log stats on; medians over the
    requests): the first token's latency, and a decode step's time (the span from the first
    token to the last over the steps it took, at the cell's mean accepted length), the
    prefill apart from the decode steps. Empty where the stats are missing."""
    first, step = [], []
    for o in outputs:
        m = getattr(o, "metrics", None)
        tokens = len(o.outputs[0].token_ids)
        if m is None or not getattr(m, "first_token_ts", 0.0) or tokens < 2:
            continue
        first.append(m.first_token_latency * 1e3)
        steps = (tokens - 1) / (accepted_length or 1.0)
        step.append((m.last_token_ts - m.first_token_ts) * 1e3 / steps)
    if not first:
        return {}
    return {"first_token_ms": statistics.median(first), "decode_step_ms": statistics.median(step)}


def timed_passes(
    run_once: Callable[[], Any],
    min_seconds: float,
    min_passes: int = 1,
    between: Callable[[], Any] | None = None,
) -> tuple[list[Any], list[float]]:
    """Run ``run_once`` until ``min_seconds`` of wall time and ``min_passes`` passes have
    passed: the outputs of every pass and each pass's wall time. A pass of a tiny pair's batch
    lasts a tenth of a second, where one hiccup of the host moves its tokens/s by a tenth or
    more; the steady rounds time a second or more of the same work instead, and the pass
    times show whether a slow cell was one slow pass or all of them. ``between`` runs before
    every pass but the first, untimed (the worker's move to the core that is fast then)."""
    outputs: list[Any] = []
    walls: list[float] = []
    while True:
        if outputs and between is not None:
            between()
        start = time.perf_counter()
        outputs.append(run_once())
        walls.append(time.perf_counter() - start)
        if sum(walls) >= min_seconds and len(walls) >= min_passes:
            return outputs, walls


def graphs_compiled() -> int:
    """Whether this process compiled graphs while its engine started, from vLLM's compilation
    counters: the compiled functions it saved to the compile cache (none where it loaded them
    all), or without vLLM's saved functions (``VLLM_USE_MEGA_AOT_ARTIFACT`` off) the graphs it
    compiled into the cache. (vLLM's Inductor compile counter is no such sign: it counts on
    starts that load every graph too.) The engine core's own process counts them: read it
    where the core runs in this one."""
    from vllm.compilation.counter import compilation_counter as counter

    if counter.num_aot_artifacts_saved or counter.num_aot_artifacts_loaded:
        return counter.num_aot_artifacts_saved
    return counter.num_cache_entries_updated


def _worker(args: argparse.Namespace) -> None:
    """One engine: start, say ready, then on each go run one batch size: once in the first
    round, for at least ``--min-seconds`` in the later ones."""
    import faulthandler

    faulthandler.dump_traceback_later(args.start_timeout - 15, exit=False)
    if args.cores:  # before vLLM and torch start their threads, which inherit it
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    from vllm import LLM, SamplingParams

    from gemma4_spec.metrics import Acceptance, spec_metrics

    config = json.loads(args.config)
    target, assistant = _pair(args.pair, Path(args.workdir))
    batches = [int(b) for b in args.batch.split(",")]
    sized = {
        "kv_cache_memory_bytes": kv_cache_bytes(target, max(batches), config["k"], args.prompt_len),
        **model_len(config["k"], args.prompt_len),
    }
    kwargs = engine_kwargs(
        args.pair,
        target,
        assistant,
        config["k"],
        config.get("spec"),
        {**sized, **json.loads(args.engine)},
    )
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    # The engine core in this process: its counters and its work are this process's to read.
    core_here = os.environ.get(CORE_IN_PROCESS_ENV) == "0"
    compiled = graphs_compiled() if core_here else None
    if args.measure_on:  # after start-up: every engine is measured on the same cores
        move_threads({int(c) for c in args.measure_on.split(",")})
    if args.scopes:  # the host's scopes of every step (engine core in process only)
        import host_scopes

        host_scopes.install()
    faulthandler.cancel_dump_traceback_later()
    # What each cell compiles, captures or allocates (the engine core's work, when it runs
    # in this process): a first pass slower than the steady ones shows what it did more.
    lazy = lazy_work.LazyWork() if core_here else None
    capacity = kv_capacity_requests(llm, request_tokens(config["k"], args.prompt_len))
    prompts = _prompts(args.pair, target, max(batches), args.prompt_len)
    # On Model Runner V2, greedy requests get a seed each, the same in every round and engine:
    # it changes no token, and fixes V2's synthetic acceptance draws (by request seed and
    # position), so every round and engine accepts the same drafts at the same steps: equal
    # work, compared. Not for sampled requests (a seed changes V2's sampling path) nor on V1
    # (its rejection sampler draws a seeded request's uniforms in a loop of its own).
    seeded = args.temperature == 0 and getattr(
        llm.llm_engine.vllm_config, "use_v2_model_runner", False
    )
    params = [
        SamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=args.temperature,
            ignore_eos=args.pair in RANDOM_PAIRS,
            seed=i if seeded else None,
        )
        for i in range(max(batches))
    ]
    control = Path(args.control)
    worker_ready(control, args.index)

    runs: dict[str, list[dict[str, Any]]] = {str(b): [] for b in batches}
    pick_from = {int(c) for c in args.measure_on.split(",")} if args.pick_core else set()
    for rnd in range(args.rounds):
        for turn, b in enumerate(batches, start=rnd * len(batches)):
            wait_turn(control, args.index, turn)
            # With the engine core in this process, this thread steps the engine: on the core
            # that is fast now, again before each later pass of the cell (a core's speed can
            # change within one), with --pick-core; else wherever the OS puts it.
            picks = host_probe.CorePicks(pick_from) if pick_from else None
            probe = picks.pick()[1] if picks else host_probe.probe_ms()
            pick = picks.pick if picks else None
            before = spec_metrics(llm.get_metrics())
            scopes = host_scopes.snapshot() if args.scopes else {}
            lazy_before = lazy.take() if lazy else None
            cpu = time.process_time()
            picking = picks.seconds if picks else 0.0

            def run_again(b: int = b) -> Any:
                return llm.generate(prompts[:b], params[:b], use_tqdm=False)

            # The first pass is one pass.
            passes, walls = timed_passes(
                run_again,
                0.0 if rnd == 0 else args.min_seconds,
                between=pick,
            )
            cpu = time.process_time() - cpu
            if picks:  # a pick is one thread's busy work, not the engine's
                cpu -= picks.seconds - picking
            clock = host_probe.gpu_sm_clock_mhz()  # as the passes left it
            probe_after = host_probe.probe_ms()  # did the core stay as fast through the cell
            wall = sum(walls)
            acc = Acceptance.between(before, spec_metrics(llm.get_metrics()))
            tokens = sum(len(o.outputs[0].token_ids) for outputs in passes for o in outputs)
            runs[str(b)].append(
                {
                    "wall_s": wall,
                    "passes": len(passes),
                    "pass_s": walls,
                    # CPU time of this process's threads (with the engine core in process:
                    # the scheduler, runner and output handling) per wall second of the cell.
                    "cpu_per_wall": cpu / wall,
                    "tokens": tokens,
                    "tokens_per_s": tokens / wall,
                    "tpot_ms": wall * 1e3 * b / tokens,
                    "mean_accepted_length": acc.mean_accepted_length
                    if acc.num_draft_tokens
                    else None,
                    "host_probe_ms": probe,
                    "host_probe_after_ms": probe_after,
                    "sm_clock_mhz": clock,
                }
            )
            if picks:
                runs[str(b)][-1].update(
                    core_probe_ms=picks.first_probes,
                    pass_cores=[core for core, _ in picks.picks],
                    pass_probe_ms=[ms for _, ms in picks.picks],
                )
            if lazy and lazy_before is not None:
                runs[str(b)][-1]["lazy"] = lazy.since(lazy_before)
            if args.scopes:
                runs[str(b)][-1]["scopes"] = scopes_per_step(scopes, host_scopes.snapshot())
            runs[str(b)][-1].update(
                request_timing(
                    [o for outputs in passes for o in outputs],
                    runs[str(b)][-1]["mean_accepted_length"],
                )
            )
            if args.pair == "trained":  # compared with plain's in the tables
                runs[str(b)][-1]["token_ids"] = [list(o.outputs[0].token_ids) for o in passes[0]]
            if rnd == 0 and args.next_passes:
                # The same batch again right after its first pass, apart from the cell's
                # figures: passes a fraction of a second from the first, so at the host's
                # speed of that moment (a steady round may run at another).
                runs[str(b)][-1]["next_pass_s"] = timed_passes(
                    run_again, 0.0, args.next_passes, between=pick
                )[1]
            turn_done(control, args.index, turn)
    Path(args.out).write_text(
        json.dumps(
            {
                "startup_s": startup_s,
                "graphs_compiled": compiled,
                "kv_cache_bytes": kwargs.get("kv_cache_memory_bytes"),
                "kv_capacity_requests": capacity,
                "runs": runs,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=PAIRS, default="e2b")
    parser.add_argument("--profiles", default=None, help=f"of {sorted(PROFILES)} + zero")
    parser.add_argument("--k", default="2,3")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {list(VARIANTS)}"
    )
    parser.add_argument("--batch", default="1,8,16,32,64")
    parser.add_argument("--rounds", type=int, default=4, help="round 0 is the first pass")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=1.0,
        help="steady rounds: each batch size's cell repeats its batch until this much wall "
        "time has passed (the first pass runs once)",
    )
    parser.add_argument(
        "--next-passes",
        type=int,
        default=3,
        help="passes of each batch size run right after its first pass, timed apart: the "
        "first pass against the passes next to it",
    )
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=0.0,
        help="wait this long after every engine is ready before the first pass (the host "
        "then runs round 0 as it runs the later rounds, not fresh from the start-ups' load)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=PROMPT_LEN,
        help="random pairs: prompt tokens a request (long ones: a long context, where the "
        "verification attention's choices differ; max_model_len and the KV cache follow)",
    )
    parser.add_argument("--workdir", default="/tmp/real-work")
    parser.add_argument("--only", default=None, help="comma-separated name prefixes to run")
    parser.add_argument("--start-timeout", type=float, default=420)
    parser.add_argument("--json", default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="of every request")
    parser.add_argument("--draft-method", choices=("greedy", "probabilistic"), default="greedy")
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="tensor_parallel_size of every engine"
    )
    parser.add_argument(
        "--engine",
        default="{}",
        help="JSON of LLM(...) arguments over the defaults (null drops one)",
    )
    parser.add_argument(
        "--engine-core",
        choices=(*ENGINE_CORES, BOTH_CORES),
        default="in-process",
        help="where each engine's core runs: beside its LLM front end (every run so far), or in "
        f"a process of its own (vLLM's default, what a server has); {BOTH_CORES}: every engine "
        f"both ways, the second named '... {OWN_CORE}'",
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="give each engine its own share of this process's CPU cores (its process and the "
        "ones it starts): one engine's threads then never run on another's cores",
    )
    parser.add_argument("--cores", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--measure-cores",
        type=int,
        default=0,
        help="after start-up, move every engine's threads to the same N cores (the last N of "
        "this process's): the engines are timed in turn, so each cell then runs on the cores "
        "the others ran on, and no engine is timed on faster or slower cores than another; "
        "before each pass, the thread that steps the engine moves to the one of them that "
        "runs the host probe fastest then (--any-core: not)",
    )
    parser.add_argument(
        "--any-core",
        action="store_true",
        help="with --measure-cores: leave the engine's thread wherever the OS puts it among "
        "those cores (runs before 2026-12-04), not on the one that runs the host probe "
        "fastest just before each pass",
    )
    parser.add_argument("--measure-on", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pick-core", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--scopes",
        action="store_true",
        help="also time the host's scopes of each engine step (benchmarks/host_scopes.py: "
        "scheduler, runner, speculator, output processing; about a microsecond a call); "
        "with the engine core in process",
    )
    parser.add_argument(
        "--table",
        default=None,
        help="print the tables of a saved --json, only (.json, or .json.xz as the large runs "
        "are kept in benchmarks/results)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print_tables(_load_saved(Path(args.table)))
        return 0
    if args.worker:
        _worker(args)
        return 0
    if args.build:
        _pair(args.pair, Path(args.workdir))
        return 0
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: a first pass and a steady one")
    if args.scopes and args.engine_core != "in-process":
        parser.error(
            "--scopes times the engine core in the worker's process: --engine-core in-process"
        )
    if args.tensor_parallel > 1:  # into every engine's LLM(...) arguments
        args.engine = json.dumps(
            {**json.loads(args.engine), "tensor_parallel_size": args.tensor_parallel}
        )
    random_pair = args.pair in RANDOM_PAIRS
    if args.prompt_len != PROMPT_LEN and not random_pair:
        parser.error("--prompt-len is for the random pairs (the trained pair asks GSM8k)")
    if args.prompt_len < 1:
        parser.error("--prompt-len must be at least 1")
    profiles = (args.profiles or ("field,poor,zero" if random_pair else REAL)).split(",")
    known = set(PROFILES) | ({ZERO} if random_pair else {REAL})
    if not set(profiles) <= known:
        parser.error(f"profiles for the {args.pair} pair: {sorted(known)}")
    configs = configurations(
        [int(k) for k in args.k.split(",")], profiles, args.variants.split(","), args.draft_method
    )
    if args.only:
        wanted = args.only.split(",")
        configs = {n: c for n, c in configs.items() if any(n.startswith(w) for w in wanted)}
    configs = with_engine_cores(configs, args.engine_core)

    workdir = Path(args.workdir)
    started = time.perf_counter()
    # Built once before the engines read it, in its own process (whose GPU memory is then free).
    subprocess.run(
        [sys.executable, __file__, "--build", "--pair", args.pair, "--workdir", str(workdir)],
        check=True,
    )
    turns = EngineTurns(workdir / f"control-{args.pair}")
    shares = core_shares(sorted(os.sched_getaffinity(0)), len(configs)) if args.pin_cores else []
    if args.pin_cores and args.measure_cores:
        parser.error("--pin-cores and --measure-cores: one or the other")
    measure_on = (
        [
            "--measure-on",
            ",".join(map(str, measure_cores(sorted(os.sched_getaffinity(0)), args.measure_cores))),
        ]
        if args.measure_cores
        else []
    )
    for index, (name, config) in enumerate(configs.items()):
        pinned = ["--cores", ",".join(map(str, shares[index]))] if shares else []
        turns.start(
            name,
            __file__,
            [
                "--pair",
                args.pair,
                "--workdir",
                str(workdir),
                "--config",
                json.dumps(config),
                "--batch",
                args.batch,
                "--rounds",
                str(args.rounds),
                "--min-seconds",
                str(args.min_seconds),
                "--next-passes",
                str(args.next_passes),
                "--start-timeout",
                str(args.start_timeout),
                "--engine",
                args.engine,
                "--temperature",
                str(args.temperature),
                "--prompt-len",
                str(args.prompt_len),
                *pinned,
                *measure_on,
                *["--pick-core"] * bool(measure_on and not args.any_core),
                *["--scopes"] * args.scopes,
            ],  # fmt: skip
            engine_env(
                config["env"],
                workdir / f"cache-{args.pair}-{index}",
                core_in_process=config["core_in_process"],
            ),
        )
    # An engine that does not start (vLLM's own path on the 26B-A4B pair) is reported, and the
    # others are measured without it.
    turns.wait_ready(args.start_timeout, drop_failed=True)
    ready = len(configs) - len(turns.not_started)
    print(f"{ready} engines ready after {time.perf_counter() - started:.0f} s", flush=True)
    # A turn is one batch size of one round: each engine's cell is timed seconds from the
    # others' same cell, so the host's drift hits them alike. Every other round runs the
    # engines in reverse order: no engine is always timed first.
    sizes = len(args.batch.split(","))
    turns.take_turns(args.rounds * sizes, reverse_every=sizes, settle_s=args.settle_seconds)
    results = turns.results()
    saved = {
        "pair": args.pair,
        "new_tokens": NEW_TOKENS,
        "prompt_len": args.prompt_len if random_pair else None,
        "temperature": args.temperature,
        "draft_method": args.draft_method,
        "tensor_parallel_size": args.tensor_parallel,
        "engine": json.loads(args.engine),
        "engine_core": args.engine_core,
        "pinned_cores": args.pin_cores,
        "measure_cores": args.measure_cores,
        "pick_core": bool(args.measure_cores and not args.any_core),
        "settle_s": args.settle_seconds,
        "results": results,
        "not_started": turns.not_started,
        "turns": turns.turn_log,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=1))
    print_tables(saved)
    return 0


def _load_saved(path: Path) -> dict[str, Any]:
    """A saved run, plain or xz-compressed (a trained pair's run keeps every request's tokens of
    every round: megabytes of JSON that compress about tenfold)."""
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    return json.loads(raw)


def print_tables(saved: dict[str, Any]) -> None:
    """Steady-state tokens/s (median of rounds 1..), each speculative run against plain and
    against the in-tree run of the same k and profile; first pass against that steady state;
    mean accepted length; start-up seconds. Then whether greedy tokens equal plain's."""
    results = saved["results"]
    plain = results["plain"]["runs"] if "plain" in results else None  # --only may leave it out
    batches = list(next(iter(results.values()))["runs"])

    def in_tree_of(name: str) -> str | None:
        variant, _, rest = name.partition(" ")
        other = f"in-tree {rest}"
        return other if rest and variant != "in-tree" and other in results else None

    temperature = saved.get("temperature", 0.0)
    sampling = "greedy" if not temperature else f"temperature {temperature}"
    drafts = saved.get("draft_method", "greedy")
    tp = saved.get("tensor_parallel_size", 1)
    core = saved.get("engine_core", "in-process")
    print(
        f"\n{saved['pair']} pair, {sampling}, {drafts} drafts, "
        + (f"{saved['prompt_len']}-token prompts, " if saved.get("prompt_len") else "")
        + f"up to {saved['new_tokens']} new tokens a request"
        + (f", TP={tp}" if tp > 1 else "")
        + (", each engine on its own CPU cores" if saved.get("pinned_cores") else "")
        + (
            f", every engine timed on the same {saved['measure_cores']} CPU cores"
            + (
                ", the engine's thread on the fastest of them at each pass"
                if saved.get("pick_core")
                else ""
            )
            if saved.get("measure_cores")
            else ""
        )
        + {
            "in-process": "",
            "own-process": ", engine cores in their own processes",
            BOTH_CORES: f", engines named '{OWN_CORE}' with their cores in their own processes",
        }[core]
    )
    print(
        "steady tokens/s (x plain, x in-tree) | first pass x own steady "
        "| mean accepted length (steady median)"
    )
    if any(_compiled_mark(result) for result in results.values()):
        print("start s: c compiled its graphs while starting, l loaded them all from the cache")
    print(f"{'configuration':24}{'start s':>8}" + "".join(f"{'B=' + b:>34}" for b in batches))
    for name, result in results.items():
        cells = []
        for b in batches:
            runs = result["runs"][b]
            tps = _steady(runs)
            cell = f"{tps:7.0f} " + (f"{tps / _steady(plain[b]):4.2f}x" if plain else "    -")
            other = in_tree_of(name)
            cell += f" {tps / _steady(results[other]['runs'][b]):4.2f}x" if other else "      "
            cell += f" | {runs[0]['tokens_per_s'] / tps:4.2f}"
            lengths = [r["mean_accepted_length"] for r in runs[1:] if r["mean_accepted_length"]]
            cell += f" | {statistics.median(lengths):4.2f}" if lengths else " |     "
            cells.append(cell)
        start = f"{result['startup_s']:.0f}{_compiled_mark(result)}"
        print(f"{name:24}{start:>8}" + "".join(f"{c:>34}" for c in cells))
    for name, lines in saved.get("not_started", {}).items():
        print(f"{name:24}  did not start: {' | '.join(lines)}")
    for name, result in results.items():  # a batch the cache cannot hold runs partly queued
        capacity = result.get("kv_capacity_requests")
        short = [b for b in batches if capacity is not None and capacity < int(b)]
        if short:
            print(
                f"{name:24}  KV cache holds {capacity:.1f} requests at once: "
                f"B={', '.join(short)} ran partly queued (not that batch size)"
            )
    print("\nsteady rounds, tokens/s: lowest - highest")
    for name, result in results.items():
        cells = []
        for b in batches:
            tps = [r["tokens_per_s"] for r in result["runs"][b][1:]]
            cells.append(f"{min(tps):7.0f} - {max(tps):7.0f}")
        print(f"{name:24}{'':8}" + "".join(f"{c:>34}" for c in cells))
    _print_host(results, batches)
    _print_request_timing(results, batches)
    _print_first_passes(results, batches)
    _print_host_drift(results, saved.get("turns", []), batches, saved.get("settle_s"))
    _print_idle_engines(saved.get("turns", []))
    paired = {name: other for name in results if (other := in_tree_of(name)) is not None}
    if paired:
        print(
            "\nsteady rounds paired with the in-tree engine's round of the same number (taken "
            "in turn, so the host's drift hits both): median ratio (lowest - highest)"
        )
    for name, other in paired.items():
        result = results[name]
        cells = []
        for b in batches:
            ratios = _paired_ratios(result["runs"][b], results[other]["runs"][b])
            cells.append(
                f"{statistics.median(ratios):4.2f}x ({min(ratios):4.2f} - {max(ratios):4.2f})"
            )
        print(f"{name:24}{'':8}" + "".join(f"{c:>34}" for c in cells))
    _print_host_matched(results, batches, paired)
    _print_targets(results, plain, batches, paired, saved.get("not_started", {}))
    _print_scopes(results, batches)
    _print_best_k(results, batches)
    # Saved copies may leave the token ids out.
    has_tokens = plain is not None and "token_ids" in plain[batches[0]][0]
    if saved["pair"] == "trained" and not temperature and has_tokens:  # bf16 near-ties differ
        print("\ngreedy tokens equal to plain's (requests equal / all, over every round)")
        for name, result in results.items():
            passes = [p for b in batches for p in zip(result["runs"][b], plain[b], strict=False)]
            same, total = _equal_requests(passes)
            print(f"  {name:24} {same} / {total}")
    if not temperature:
        _print_repeats(results, batches)


def _compiled_mark(result: dict[str, Any]) -> str:
    """``c`` after the start seconds of an engine that compiled graphs as it started, ``l``
    after one that loaded them all from the compile cache; nothing where unknown."""
    compiled = result.get("graphs_compiled")
    return "" if compiled is None else ("c" if compiled else "l")


def _print_repeats(results: dict[str, Any], batches: list[str]) -> None:
    """Greedy engines that recorded their tokens: each round's requests against the same
    engine's first pass. An engine repeats the same batch of greedy requests token for token
    (bf16 too: the same kernels over the same batches), so a request that differs says state
    of an earlier request reached it (the eleventh H200 session's V2 verification graphs)."""
    rows = []
    for name, result in results.items():
        cells = [result["runs"][b] for b in batches]
        if not all(runs and "token_ids" in runs[0] for runs in cells):
            continue
        same, total = _equal_requests([(later, runs[0]) for runs in cells for later in runs[1:]])
        if total:
            rows.append(f"  {name:24} {same} / {total}" + ("" if same == total else "  DIFFER"))
    if rows:
        print(
            "\ngreedy tokens equal to the engine's own first pass "
            "(requests equal / all, later rounds)"
        )
        print("\n".join(rows))


def _equal_requests(passes: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[int, int]:
    """Over (pass, the pass it is held to) pairs of the same requests: how many requests gave
    the same tokens in both, and how many there were."""
    same = total = 0
    for run, base in passes:
        pairs = zip(run["token_ids"], base["token_ids"], strict=True)
        same += sum(x == y for x, y in pairs)
        total += len(run["token_ids"])
    return same, total


def _print_idle_engines(turns: list[dict[str, Any]]) -> None:
    """While each engine took its turns: the CPU seconds the engines waiting for theirs used,
    per wall second of the turns (median and highest turn). Waiting engines should be idle; a
    busy one takes CPU from the engine being timed, on shared cores above all (runs saved
    before this was recorded print nothing)."""
    if not turns:
        return
    print(
        "\nengines waiting their turn: CPU s per wall s while each engine was timed (median, max)"
    )
    for name in dict.fromkeys(turn["engine"] for turn in turns):
        rates = [
            t["others_cpu_s"] / t["wall_s"] for t in turns if t["engine"] == name and t["wall_s"]
        ]
        if rates:
            print(f"  {name:24} {statistics.median(rates):5.2f}  {max(rates):5.2f}")


def _print_host_drift(
    results: dict[str, Any],
    turns: list[dict[str, Any]],
    batches: list[str],
    settle_s: float | None,
) -> None:
    """The host while round 0 (the first passes) ran, against the later rounds, per engine:
    the host probe (``host_probe.py``: fixed Python work, ms; higher is a slower CPU), the CPU
    seconds per wall second that the rest of the machine (not the engines) used during the
    engine's turns, and the GPU's SM clock after a cell's passes. A round 0 slower on these
    counts ran on a slower machine, not the engine's first passes. Runs saved before these
    were recorded print nothing."""
    first_cells = [r["runs"][b][0] for r in results.values() for b in batches]
    if not all("host_probe_ms" in cell for cell in first_cells):
        return
    after = f", {settle_s:.0f} s after the engines were ready" if settle_s else ""
    print(
        f"\nthe host in round 0{after} | in the later rounds (medians): probe ms; "
        "the rest of the machine's CPU s per wall s in the engine's turns; GPU SM clock MHz"
    )
    for name, result in results.items():
        first = statistics.median(result["runs"][b][0]["host_probe_ms"] for b in batches)
        later = statistics.median(
            r["host_probe_ms"] for b in batches for r in result["runs"][b][1:]
        )
        line = f"  {name:24} probe {first:6.3f} | {later:6.3f} ({first / later:4.2f}x)"
        own = [t for t in turns if t["engine"] == name and "rest_cpu_s" in t and t["wall_s"]]
        if len(own) > len(batches):  # the first len(batches) turns of an engine are round 0
            rates = [t["rest_cpu_s"] / t["wall_s"] for t in own]
            round0, rest = rates[: len(batches)], rates[len(batches) :]
            line += f"   rest {statistics.median(round0):5.2f} | {statistics.median(rest):5.2f}"
        clocks = [[r.get("sm_clock_mhz") for r in result["runs"][b]] for b in batches]
        if all(c is not None for cells in clocks for c in cells):
            round0_mhz = statistics.median(cells[0] for cells in clocks)
            later_mhz = statistics.median(c for cells in clocks for c in cells[1:])
            line += f"   SM {round0_mhz:5.0f} | {later_mhz:5.0f}"
        print(line)


# A cell ran on a slow host when a probe around it (before or after its passes) took this much
# longer than the run's fastest probe: the two speeds a core runs at are about 2x apart.
SLOW_HOST = 1.3


def _probes(cell: dict[str, Any]) -> list[float]:
    """The host probes (ms) around one cell: before its passes, before each later pass (the
    core picks') and after them, where recorded."""
    around = [
        cell.get("host_probe_ms"),
        *cell.get("pass_probe_ms", []),
        cell.get("host_probe_after_ms"),
    ]
    return [p for p in around if p]


def _fast_host(cell: dict[str, Any], floor: float) -> bool:
    return all(p <= SLOW_HOST * floor for p in _probes(cell))


def _print_host_matched(
    results: dict[str, Any], batches: list[str], paired: dict[str, str]
) -> None:
    """The figures again from cells that ran on a fast host only (every probe around the cell
    within ``SLOW_HOST`` of the run's fastest): per engine, how many cells ran on a slow one
    (round 0 | later rounds); per speculative engine, the paired steady ratio over the rounds
    whose cells ran fast on both sides (median, pairs used / all), and the first pass, when it
    ran fast, over the engine's fast steady cells. Host-bound cells run at about half speed on
    a slow core, so a pair or a first pass that straddles the two speeds measures the host.
    Runs saved before the probes were recorded print nothing."""
    cells = [r for result in results.values() for b in batches for r in result["runs"][b]]
    if not all(_probes(cell) for cell in cells):
        return
    floor = min(p for cell in cells for p in _probes(cell))
    print(
        f"\nhost-matched: cells whose probes ran within {SLOW_HOST}x of the run's fastest "
        f"({floor:.3f} ms); slow cells in round 0 | later rounds; steady over in-tree on "
        "rounds fast for both (median, pairs used / all) | first pass over own fast steady "
        "cells (- where the first ran slow)"
    )
    for name, result in results.items():
        slow0 = sum(not _fast_host(result["runs"][b][0], floor) for b in batches)
        later = [r for b in batches for r in result["runs"][b][1:]]
        slow = sum(not _fast_host(r, floor) for r in later)
        line = f"  {name:24}slow {slow0}/{len(batches)} | {slow}/{len(later)}"
        other = paired.get(name)
        if other is None:
            print(line)
            continue
        row = []
        for b in batches:
            runs = result["runs"][b]
            both = _paired_ratios(
                runs, results[other]["runs"][b], keep=lambda cell: _fast_host(cell, floor)
            )
            ratio = f"{statistics.median(both):4.2f}x" if both else "   - "
            fast = [r["tokens_per_s"] for r in runs[1:] if _fast_host(r, floor)]
            first = (
                f"{runs[0]['tokens_per_s'] / statistics.median(fast):4.2f}"
                if fast and _fast_host(runs[0], floor)
                else "   -"
            )
            row.append(f"{ratio} ({len(both)}/{len(runs) - 1}) | {first}")
        print(line)
        print(f"{'':32}" + "".join(f"{c:>34}" for c in row))


def _has_pass_times(results: dict[str, Any], batches: list[str]) -> bool:
    """Whether a saved run recorded each pass's wall time (runs from 6a049fd on)."""
    first = next(iter(results.values()))["runs"][batches[0]]
    return "pass_s" in first[-1]


def _print_host(results: dict[str, Any], batches: list[str]) -> None:
    """Over the steady cells (medians): the process's CPU seconds per wall second, and the
    slowest pass of a cell over its fastest. A CPU figure near 1 with the engine core in
    process says the step waits on one Python thread; a wide pass spread in a cell says the
    cell's spread is the host's hiccups, not the engine's work. Runs saved before these
    fields existed print nothing."""
    if not _has_pass_times(results, batches):
        return
    print("\nsteady cells (medians): CPU s per wall s of this process | slowest / fastest pass")
    for name, result in results.items():
        cells = []
        for b in batches:
            steady = result["runs"][b][1:]
            cpu = statistics.median(r["cpu_per_wall"] for r in steady)
            spread = statistics.median(max(r["pass_s"]) / min(r["pass_s"]) for r in steady)
            cells.append(f"{cpu:4.2f} | {spread:4.2f}")
        print(f"{name:24}{'':8}" + "".join(f"{c:>34}" for c in cells))


def _print_request_timing(results: dict[str, Any], batches: list[str]) -> None:
    """Steady cells' medians of ``request_timing``: a step's time apart from the prefill."""
    cells = [c for r in results.values() for b in batches for c in r["runs"][b][1:]]
    if not any("decode_step_ms" in c for c in cells):
        return
    print("\nsteady cells (medians): a request's first token ms | its decode steps' ms a step")
    for name, result in results.items():
        row = []
        for b in batches:
            steady = [c for c in result["runs"][b][1:] if "decode_step_ms" in c]
            if not steady:
                row.append(f"{'-':>34}")
                continue
            first = statistics.median(c["first_token_ms"] for c in steady)
            step = statistics.median(c["decode_step_ms"] for c in steady)
            row.append(f"{first:8.1f} | {step:6.3f}".rjust(34))
        print(f"{name:32}" + "".join(row))


def _print_first_passes(results: dict[str, Any], batches: list[str]) -> None:
    """Each first pass against the same engine's steady passes (one pass each, so a first
    pass slower than the slowest of them is not the host's usual spread), and what the passes
    did that start-up could have done (``lazy_work.py``; runs with the engine core in process
    from when it was recorded)."""
    if not _has_pass_times(results, batches):
        return
    print(
        "\nfirst pass, ms: steady passes' median and slowest (slower first passes than any "
        "steady one marked *); the passes run right after it (median; the first's speed over "
        "theirs); what it did that start-up could have"
    )
    for name, result in results.items():
        print(f"  {name}")
        for b in batches:
            runs = result["runs"][b]
            steady = [s for r in runs[1:] for s in r["pass_s"]]
            took = runs[0]["pass_s"][0]
            mark = "*" if took > max(steady) else " "
            line = (
                f"    B={b:<4}{took * 1e3:8.1f}{mark} ({statistics.median(steady) * 1e3:.1f}, "
                f"{max(steady) * 1e3:.1f})"
            )
            beside = _first_over_next(runs[0])
            if beside is not None:
                line += f"  next: {statistics.median(runs[0]['next_pass_s']) * 1e3:.1f}"
                line += f" (first x next {beside:4.2f})"
            if "lazy" in runs[0]:
                line += f"  first: {lazy_work.describe(runs[0]['lazy'])}"
                kernels = runs[0]["lazy"].get("triton_kernels", [])
                if kernels:
                    line += f" [{'; '.join(k.split('[', 1)[0] for k in kernels[:4])}]"
                later = lazy_work.total([r["lazy"] for r in runs[1:] if "lazy" in r])
                line += f"; steady cells: {lazy_work.describe(later)}"
            print(line)


def _print_scopes(results: dict[str, Any], batches: list[str]) -> None:
    """Each engine's host scopes per step, the median over its steady cells (runs with
    ``--scopes`` only)."""
    from host_scopes import print_table

    for name, result in results.items():
        steady = {b: result["runs"][b][1:] for b in batches}
        if not all(cells and "scopes" in cells[0] for cells in steady.values()):
            continue
        medians = {
            b: {
                scope: [statistics.median(c["scopes"][scope][i] for c in cells) for i in range(3)]
                for scope in cells[0]["scopes"]
                if all(scope in c["scopes"] for c in cells)
            }
            for b, cells in steady.items()
        }
        print_table(f"{name} (steady cells' median)", medians, batches)
        _print_first_pass_scopes(name, result, medians, batches)


def _print_first_pass_scopes(
    name: str,
    result: dict[str, Any],
    steady: dict[str, dict[str, list[float]]],
    batches: list[str],
) -> None:
    """Where a first pass spends more host time a step than the steady cells: the scopes
    whose wall time per step differs most (the two outermost left out: they hold all)."""
    from host_scopes import largest_differences

    print(f"{name}: first pass minus steady, ms per step, largest scope differences")
    for b in batches:
        first = result["runs"][b][0].get("scopes")
        if first:
            print(f"  B={b}: {largest_differences(first, steady[b], 5)}")


def _first_over_next(first: dict[str, Any]) -> float | None:
    """The first pass's speed over the passes run right after it (the same work, their median
    time over its time); None for runs without them (``--next-passes 0``, or saved before
    they were recorded)."""
    after = first.get("next_pass_s")
    return statistics.median(after) / first["pass_s"][0] if after else None


def _steady(runs: list[dict[str, Any]]) -> float:
    """Steady-state tokens/s: the median of the rounds after the first pass."""
    return statistics.median(r["tokens_per_s"] for r in runs[1:])


def _paired_ratios(
    runs: list[dict[str, Any]],
    others: list[dict[str, Any]],
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> list[float]:
    """Each steady round's tokens/s over the other engine's round of the same number; with
    ``keep``, only the rounds whose cells it keeps on both sides."""
    pairs = zip(runs[1:], others[1:], strict=False)
    if keep is not None:
        pairs = ((x, y) for x, y in pairs if keep(x) and keep(y))
    return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in pairs]


def _name_parts(name: str) -> tuple[str, int | None, str]:
    """An engine's name ``<variant> k=<k> <profile>`` (``own-core`` stays in the profile) as
    its variant, k and profile; k None for plain."""
    variant, _, rest = name.partition(" k=")
    k, _, profile = rest.partition(" ")
    return variant, int(k) if k.isdigit() else None, profile


def _print_best_k(results: dict[str, Any], batches: list[str]) -> None:
    """Where one variant and profile ran at several k: the fastest k at each batch size, and
    the schedule vLLM's ``num_speculative_tokens_per_batch_size`` takes for it (a measured
    batch size's k holds up to the next one measured)."""
    by_run: dict[tuple[str, str], dict[int, str]] = {}
    for name in results:
        variant, k, profile = _name_parts(name)
        if k is not None:
            by_run.setdefault((variant, profile), {})[k] = name
    several = {run: ks for run, ks in by_run.items() if len(ks) > 1}
    if not several:
        return
    print("\nfastest k by batch size (steady tokens/s), as a dynamic speculation-length schedule")
    for (variant, profile), ks in several.items():
        best = []
        for b in batches:
            tps = {k: _steady(results[name]["runs"][b]) for k, name in ks.items()}
            best.append(max(tps, key=lambda k: tps[k]))
        sizes = [int(b) for b in batches]
        schedule: list[list[int]] = []
        for i, k in enumerate(best):
            end = sizes[i + 1] - 1 if i + 1 < len(sizes) else 1024
            if schedule and schedule[-1][2] == k:
                schedule[-1][1] = end  # the same k as the range before: one range
            else:
                schedule.append([1 if i == 0 else sizes[i], end, k])
        cells = "".join(f"{'k=' + str(k):>34}" for k in best)
        print(f"{variant + ' ' + profile:24}{'':8}{cells}")
        print(f"  num_speculative_tokens_per_batch_size: {schedule}")


# The speed issue's targets: steady tokens/s at least this much over in-tree's (paired per
# round), a first pass at least this much of the run's own steady state, and with nothing
# accepted a step costing at most this much over plain's, its rounds within this of each other.
TARGET_OVER_IN_TREE = 1.15
TARGET_FIRST_PASS = 0.9
TARGET_ZERO_STEP = 1.08
TARGET_ZERO_SPREAD = 0.05
# Where they apply: the batch sizes of every acceptance profile; the nothing-accepted row is
# k=2 at these batch sizes (and no target over in-tree).
TARGET_BATCHES = ("1", "8", "16", "32", "64")
ZERO_TARGET_K, ZERO_TARGET_BATCHES = 2, ("1", "8", "32")


def _zero_row(name: str) -> bool:
    """Whether the engine verifies with nothing accepted (in either core mode)."""
    return _name_parts(name.removesuffix(f" {OWN_CORE}"))[2] == ZERO


def _target_misses(
    name: str,
    b: str,
    results: dict[str, Any],
    plain: dict[str, Any] | None,
    paired: dict[str, str],
) -> list[str]:
    """What one of ours' cells misses of the targets that apply to it (three decimals, so a
    figure just under a threshold does not print as the threshold)."""
    runs = results[name]["runs"][b]
    own_core = name.endswith(f" {OWN_CORE}")
    misses = []
    if not _zero_row(name):
        other = paired.get(name)
        if other is None:
            misses.append("no in-tree run")  # the target over in-tree is not measured
        else:
            ratio = statistics.median(_paired_ratios(runs, results[other]["runs"][b]))
            if ratio < TARGET_OVER_IN_TREE:
                misses.append(f"{ratio:.3f}x")
    first = runs[0]["tokens_per_s"] / _steady(runs)
    if first < TARGET_FIRST_PASS:
        beside = _first_over_next(runs[0])
        nearby = f" ({beside:.2f} x next)" if beside is not None else ""
        misses.append(f"first {first:.3f}{nearby}")
    if _zero_row(name) and _name_parts(name)[1] == ZERO_TARGET_K and b in ZERO_TARGET_BATCHES:
        # An own-core engine against the own-core plain engine, as its in-tree pairing does.
        reference = plain
        if own_core:
            reference = results.get(f"plain {OWN_CORE}", {}).get("runs")
        if reference is None:
            misses.append("no plain run")
        else:
            # Nothing accepted: a step makes one token a request, as plain's does.
            steps = _paired_ratios(reference[b], runs)
            step = statistics.median(steps)
            if step > TARGET_ZERO_STEP or max(steps) - min(steps) > TARGET_ZERO_SPREAD:
                misses.append(f"step {step:.3f} ({min(steps):.3f}-{max(steps):.3f})")
    return misses


def _print_targets(
    results: dict[str, Any],
    plain: dict[str, Any] | None,
    batches: list[str],
    paired: dict[str, str],
    not_started: Iterable[str] = (),
) -> None:
    """Each of ours' cells against the speed issue's targets: 'met' or the figures that miss;
    ours' engines that did not start, and the batch sizes the targets ask for that this run
    left out."""
    ours = [name for name in results if name.startswith("ours")]
    failed = [name for name in not_started if name.startswith("ours")]
    if not ours and not failed:
        return
    print(
        f"\ntargets: steady >= {TARGET_OVER_IN_TREE}x in-tree (paired median), first pass >= "
        f"{TARGET_FIRST_PASS} of own steady; nothing accepted (k={ZERO_TARGET_K}, B = "
        f"{', '.join(ZERO_TARGET_BATCHES)}): a step <= {TARGET_ZERO_STEP}x plain's, rounds "
        f"within {TARGET_ZERO_SPREAD}"
    )
    for name in ours:
        cells = [
            ", ".join(_target_misses(name, b, results, plain, paired)) or "met" for b in batches
        ]
        print(f"{name:24}{'':8}" + "".join(f"{c:>34}" for c in cells))
    for name in failed:
        print(f"{name:24}{'':8}  did not start: no target measured")
    asked = ZERO_TARGET_BATCHES if all(map(_zero_row, ours)) else TARGET_BATCHES
    left_out = [b for b in asked if b not in batches]
    if ours and left_out:
        print(f"not measured in this run (the targets ask for them): B = {', '.join(left_out)}")


if __name__ == "__main__":
    sys.exit(main())
