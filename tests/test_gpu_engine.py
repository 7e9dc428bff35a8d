"""The plugin on a CUDA GPU, with CUDA graphs: vLLM's V1 runner is selected for gemma4_mtp, our
proposer drafts, its whole draft loop (and, on the step-by-step path, its greedy sampling) is
replayed from captured graphs, and greedy output equals decoding without speculation, token for
token (float32).

Skipped without CUDA (CI and the CPU machines); run on the GPU machine (see benchmarks/results/
for the commands and outputs). The tiny assistant is 64 wide over a 128-wide target: like every
real assistant, its width differs from the target's, where vLLM 0.26's own V1 path keeps the
draft's embedding and fails to start (vllm#47794); ours attaches the target's.
"""

from __future__ import annotations

import random

import pytest
import torch

from gemma4_spec.testing.engine_run import (
    PLUGIN_DRAFT_MODEL,
    PLUGIN_PROPOSER,
    PLUGIN_V2_SPECULATOR,
    RunConfig,
    engine_kwargs,
    generate_in_subprocess,
    gpu_run_fields,
)
from gemma4_spec.testing.kv_norms import add_missing_k_norms
from gemma4_spec.testing.suppressing_target import (
    ARCHITECTURE,
    MODEL_CLASS,
    build_suppressing_pair,
)
from gemma4_spec.testing.tiny import (
    build_tiny_assistant,
    build_tiny_e2b_like_target,
    build_tiny_pair,
)


def on_gpu(test):  # type: ignore[no-untyped-def]
    """Every test but the configuration check starts engines on a GPU."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.engine(needs_cuda(test))


V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
PROMPT_LENGTHS = (3, 9, 21, 40, 70)
MAX_TOKENS = 48


def _pairs(root):  # type: ignore[no-untyped-def]
    target, assistant = build_tiny_pair(root, centroids=True, style="copy")
    e2b = build_tiny_e2b_like_target(root / "e2b", multimodal=False)
    add_missing_k_norms(e2b)  # vLLM 0.26 wants one on the KV-shared layers too
    e2b_assistant = build_tiny_assistant(root / "e2b-assistant", e2b, centroids=True)
    return (("tiny", target, assistant), ("e2b", e2b, e2b_assistant))


def _run_on(runner: str, root, suppressing=None):  # type: ignore[no-untyped-def]
    """Plain and ours for each pair, every engine on one model runner ("0": V1, "1": V2): vLLM
    0.26 keeps process-global CUDA-graph state that a V1 engine leaves unfit for a later V2
    engine in the same process ("CUDA graph capturing detected at an inappropriate time"), so
    each runner gets its own process. Greedy float32 output does not depend on the runner."""
    configs = _configs(_pairs(root), v2=runner == "1")
    if suppressing is not None:
        configs.update(_suppressing_configs(*suppressing[:2]))
    env = {"VLLM_USE_V2_MODEL_RUNNER": runner}
    results = generate_in_subprocess(list(configs.values()), env=env)
    return dict(zip(configs, results, strict=True))


def _suppressing_configs(target, assistant) -> dict[str, RunConfig]:  # type: ignore[no-untyped-def]
    common = dict(
        gpu_run_fields(str(target), _prompts(), MAX_TOKENS),
        register_models={ARCHITECTURE: MODEL_CLASS},
    )
    return {
        "e2b-suppress-plain": RunConfig(**common),
        "e2b-suppress-ours": RunConfig(
            **common, assistant=str(assistant), num_speculative_tokens=3
        ),
    }


# Synthetic acceptance (vLLM's benchmark mode): unconditional rates by draft position.
SYNTHETIC_RATES = [0.9, 0.6, 0.3]
# The prompts again, as four successive batches in alternating order: each batch's requests
# take the request slots the last one left, at other prompt lengths.
AGAIN_ORDER = [*range(5), *range(4, -1, -1), *range(5), *range(4, -1, -1)]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]


def _configs(pairs, v2: bool = False) -> dict[str, RunConfig]:  # type: ignore[no-untyped-def]
    """name -> the engine of that name on ``pairs`` (``_pairs``), for either runner (``v2``:
    the V2-only ones too)."""
    prompts = _prompts()
    configs = {}
    for name, tgt, drafter in pairs:
        common = gpu_run_fields(str(tgt), prompts, MAX_TOKENS)
        ours = dict(common, assistant=str(drafter), num_speculative_tokens=3)
        configs[f"{name}-plain"] = RunConfig(**common)
        configs[f"{name}-ours"] = RunConfig(**ours)
        if name == "tiny":  # vLLM's dynamic speculation length: k = 3 alone, k = 1 for four
            batches = [1, len(prompts) - 1]
            schedule = [[1, 1, 3], [2, 64, 1]]
            configs["tiny-plain-batched"] = RunConfig(**common, request_batches=batches)
            configs["tiny-dynamic-k"] = RunConfig(
                **ours,
                request_batches=batches,
                speculative_options={"num_speculative_tokens_per_batch_size": schedule},
            )
            again = [prompts[i] for i in AGAIN_ORDER]
            configs["tiny-ours-again"] = RunConfig(
                **dict(ours, prompts=again), request_batches=[len(prompts)] * 4
            )
            if v2:  # our greedy verification draws synthetic acceptance as V2 does
                synthetic = {
                    "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": SYNTHETIC_RATES,
                }
                configs["tiny-synthetic"] = RunConfig(
                    **ours, speculative_options=synthetic, count_triton_compiles=True
                )
    return configs


def test_engine_configurations_build(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Runs everywhere (CPU too): the engines this module starts on a GPU can be described at
    # all (a broken description fails every GPU test of the module at set-up), and the dynamic
    # one keeps the GPU engines' arguments beside its speculative config.
    pairs = _pairs(tmp_path)
    configs = _configs(pairs)
    dynamic = engine_kwargs(configs["tiny-dynamic-k"])
    assert (
        dynamic["kv_cache_memory_bytes"]
        == engine_kwargs(configs["tiny-ours"])["kv_cache_memory_bytes"]
    )
    assert dynamic["speculative_config"]["num_speculative_tokens_per_batch_size"]
    synthetic = engine_kwargs(_configs(pairs, v2=True)["tiny-synthetic"])
    assert synthetic["speculative_config"]["rejection_sample_method"] == "synthetic"
    assert "tiny-synthetic" not in configs  # V1's gate sends synthetic batches to vLLM


@pytest.fixture(scope="module")
def runs(tmp_path_factory):  # type: ignore[no-untyped-def]
    return _run_on("0", tmp_path_factory.mktemp("gpu-v1"))


@pytest.fixture(scope="module")
def suppressing(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The E2B-shaped target (the same weights as ``_pairs``'s) suppressing two tokens of its
    greedy continuations, as the published checkpoints' class suppresses its own
    (``testing/suppressing_target.py``): (target, assistant, suppressed tokens)."""
    target, assistant, suppressed = build_suppressing_pair(
        tmp_path_factory.mktemp("gpu-suppress"), _prompts(), MAX_TOKENS
    )
    add_missing_k_norms(target)  # after transformers' reference, which has no use for them
    return target, assistant, suppressed


@pytest.fixture(scope="module")
def v2_runs(tmp_path_factory, suppressing):  # type: ignore[no-untyped-def]
    return _run_on("1", tmp_path_factory.mktemp("gpu-v2"), suppressing)


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_model_runner_v2_drafts_with_our_model_losslessly(v2_runs, target: str) -> None:  # type: ignore[no-untyped-def]
    # Model Runner V2: our speculator (spec_decode/runner_v2.py, vLLM's Gemma4 speculator with
    # our draft loop) runs our assistant model, greedy drafts through its get_top_tokens (the
    # centroid argmax), and the output is plain decoding's.
    plain, ours = v2_runs[f"{target}-plain"], v2_runs[f"{target}-ours"]
    assert ours.runner_class != V1_RUNNER
    assert ours.drafter_class == PLUGIN_V2_SPECULATOR
    assert ours.draft_model_class == PLUGIN_DRAFT_MODEL
    assert ours.token_ids == plain.token_ids
    metrics = ours.spec_metrics
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    # The draft loop ran, decode steps replayed from the graphs captured at start-up (the
    # prompts' prefill steps, mixed batches included, are drafted as one-query steps too).
    assert ours.v2_loop_replays > 0
    # Every batch is greedy and plain: verified without V2's rejection sampling
    # (patch/patch_v2_rejection_sampler.py), through these equal tokens.
    assert ours.greedy_verify_batches > 0
    assert plain.greedy_verify_batches == 0
    # The E2B-shaped target soft-caps its logits as the real one does: they were computed
    # without the cap's passes and the capped argmax taken in one read
    # (patch/patch_v2_sample.py), through these equal tokens. The tiny target has no cap:
    # vLLM's path, nothing to skip.
    if target == "e2b":
        assert ours.greedy_verify_uncapped > 0
    else:
        assert ours.greedy_verify_uncapped == 0
    # Decode batches (every request with its k drafts) replayed their verification from the
    # graphs captured at start-up (spec_decode/verify_graphs.py), through these equal tokens.
    assert ours.greedy_verify_graphed > 0
    # The target's verification attention ran on the split-key kernel
    # (patch/patch_triton_attn.py), through these equal tokens.
    assert ours.flat_verify_rewrites > 0
    assert plain.flat_verify_rewrites == 0


# Verification attention settings, each in a process of its own (they are read when the
# attention backend is patched).
ATTENTION_VARIANTS = {
    "segments-4": {"GEMMA4_SPEC_VERIFY_SEGMENTS": "4"},
    "own-split": {"GEMMA4_SPEC_OWN_SPLIT_ATTENTION": "1"},
    # Our kernel for the sliding layers, vLLM's at 8 segments for the full ones, in one step.
    "own-sliding-segments-8": {
        "GEMMA4_SPEC_OWN_SPLIT_ATTENTION": "sliding",
        "GEMMA4_SPEC_VERIFY_SEGMENTS": "8",
    },
    # The default for large verification batches (our kernel on the sliding layers, vLLM's at
    # 4 segments on the full ones), from 8 query tokens so that this test's batches reach it.
    "own-large-batch-default": {"GEMMA4_SPEC_LARGE_VERIFY_TOKENS": "8"},
    # The draft's attention on our kernel (every draft layer), the verification's as default.
    "own-draft": {"GEMMA4_SPEC_OWN_DRAFT_ATTENTION": "1"},
    # Not attention settings, run the same way: the draft without its fused kernels (the
    # default since the thirty-second session), its gate/up matmul and activation as two
    # launches and its query norm and rotary embedding as Inductor's.
    "unfused-draft": {"GEMMA4_SPEC_FUSED_GELU": "0", "GEMMA4_SPEC_FUSED_QROPE": "0"},
    # The target's matmuls on the small-rows kernel up to its row cap (opt-in).
    "target-linear": {"GEMMA4_SPEC_TARGET_LINEAR": "1"},
}


@pytest.fixture(scope="module")
def attention_variant_runs(tmp_path_factory):  # type: ignore[no-untyped-def]
    """variant -> (plain, ours) on the E2B-shaped pair, Model Runner V2; each variant's engines
    run when a test first asks for it (``-k`` picks some without paying for the others)."""
    root = tmp_path_factory.mktemp("gpu-v2-attention")
    pairs = [pair for pair in _pairs(root) if pair[0] == "e2b"]
    configs = _configs(pairs, v2=True)
    runs = {}

    def run(variant: str) -> tuple:
        if variant not in runs:
            env = {"VLLM_USE_V2_MODEL_RUNNER": "1", **ATTENTION_VARIANTS[variant]}
            results = generate_in_subprocess(list(configs.values()), env=env)
            named = dict(zip(configs, results, strict=True))
            runs[variant] = (named["e2b-plain"], named["e2b-ours"])
        return runs[variant]

    return run


@on_gpu
@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS))
def test_v2_verification_attention_settings_are_lossless(
    attention_variant_runs, variant: str
) -> None:  # type: ignore[no-untyped-def]
    # Fewer softmax segments on vLLM's split kernel, and our own split kernel: the verification
    # ran through them (rewritten batches; our kernel's calls), and greedy float32 output is
    # plain decoding's.
    plain, ours = attention_variant_runs(variant)
    assert ours.token_ids == plain.token_ids
    assert ours.flat_verify_rewrites > 0
    if variant.startswith("own-"):  # a process-wide count: the process ran only these engines
        assert ours.own_split_calls > 0
    if variant == "target-linear":  # plain decoding loads no drafter: its target keeps cuBLAS
        assert ours.target_rows_layers > 0 and plain.target_rows_layers == 0


@on_gpu
def test_v2_verification_graphs_serve_a_target_that_suppresses_tokens(v2_runs, suppressing) -> None:  # type: ignore[no-untyped-def]
    # The published checkpoints' class sets its generation config's suppress_tokens to -inf by
    # list indexing, which a CUDA graph capture does not allow; our verification suppresses
    # them from a device tensor (patch/patch_v2_sample.py), and its graphs still serve.
    free, plain = v2_runs["e2b-plain"], v2_runs["e2b-suppress-plain"]
    ours = v2_runs["e2b-suppress-ours"]
    assert plain.token_ids != free.token_ids  # the suppression bites: the same weights
    assert not {t for tokens in plain.token_ids for t in tokens} & set(suppressing[2])
    assert ours.token_ids == plain.token_ids
    assert ours.drafter_class == PLUGIN_V2_SPECULATOR
    assert ours.greedy_verify_uncapped > 0
    assert ours.greedy_verify_graphed > 0


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_v2_drafts_equal_our_v1_proposers(runs, v2_runs, target: str) -> None:  # type: ignore[no-untyped-def]
    # Both runners draft each step from each request's last accepted token with keys up to it
    # alone, so in float32 they propose the same drafts: the same tokens accepted at every
    # draft position (vLLM's own V2 speculator keeps the rejected tokens' keys in its later
    # draft steps, and accepts fewer).
    v1, v2 = runs[f"{target}-ours"], v2_runs[f"{target}-ours"]
    for name in (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert v2.spec_metrics[name] == v1.spec_metrics[name], name


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_greedy_output_equals_plain_decoding(runs, target: str) -> None:  # type: ignore[no-untyped-def]
    plain, ours = runs[f"{target}-plain"], runs[f"{target}-ours"]
    assert ours.token_ids == plain.token_ids
    metrics = ours.spec_metrics
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert (
        metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]
    )
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == metrics["vllm:spec_decode_num_accepted_tokens"]


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_v1_runner_our_proposer_and_graphed_sampling(runs, target: str) -> None:  # type: ignore[no-untyped-def]
    ours = runs[f"{target}-ours"]
    assert ours.runner_class == V1_RUNNER
    assert ours.drafter_class == PLUGIN_PROPOSER
    # The runner captures drafter graphs for a range of batch sizes (from k + 1 up); our
    # sampler is captured for each of them, so this batch replays one.
    sizes = ours.sampler_graph_sizes
    assert len(sizes) > 1 and min(sizes) <= len(PROMPT_LENGTHS) <= max(sizes)


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_whole_draft_loop_replayed_from_a_graph(runs, target: str) -> None:  # type: ignore[no-untyped-def]
    # The k steps with their attention and sampling, one graph per (padded batch, k), all
    # captured at engine start-up: the equal-output test above ran through these replays, and
    # no batch (1 to 5 requests) found its size missing.
    ours = runs[f"{target}-ours"]
    assert ours.draft_loop_graphs_off is None
    assert ours.draft_loop_captured_at_startup
    sizes = [size for size, _ in ours.draft_loop_graphs]
    assert min(sizes) == 1 and max(sizes) >= len(PROMPT_LENGTHS)
    assert all(k == 3 for _, k in ours.draft_loop_graphs)
    assert ours.draft_loop_misses == 0
    # Replays restage the inputs in one launch and, on TRITON_ATTN, rebuild no metadata.
    assert ours.draft_loop_replays > 0
    assert ours.draft_loop_rebuild_free


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_verification_attention_ran_on_the_split_kernel(runs, target: str) -> None:  # type: ignore[no-untyped-def]
    # patch/patch_triton_attn.py: the target's verification batches went through the Triton
    # split-key kernel; the equal-output test above ran through them. Plain decoding has no
    # verification batches.
    assert runs[f"{target}-ours"].flat_verify_rewrites > 0
    assert runs[f"{target}-plain"].flat_verify_rewrites == 0


@on_gpu
@pytest.mark.parametrize("target", ["tiny", "e2b"])
def test_verification_took_the_plugin_paths(runs, target: str) -> None:  # type: ignore[no-untyped-def]
    # The equal-output test ran through these: verification index arrays in one transfer
    # (spec_decode/verify_metadata.py), greedy batches verified by one argmax and one kernel
    # (patch/patch_rejection_sampler.py), carried tokens written from one transfer.
    assert runs[f"{target}-ours"].verify_metadata_builds > 0
    assert runs[f"{target}-ours"].greedy_verify_batches > 0
    # Async scheduling (on by default on CUDA): the carried tokens went through our writer
    # (spec_decode/verify_input_ids.py).
    assert runs[f"{target}-ours"].verify_input_ids_writes > 0
    # In steady decoding: block copies, reused index arrays, draft starts replayed from graphs.
    assert runs[f"{target}-ours"].verify_input_ids_uniform > 0
    assert runs[f"{target}-ours"].verify_metadata_reuses > 0
    assert runs[f"{target}-ours"].draft_start_graph_replays > 0
    assert runs[f"{target}-ours"].correction_graph_replays > 0


@on_gpu
@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_dynamic_speculation_length(request, runner: str) -> None:  # type: ignore[no-untyped-def]
    # num_speculative_tokens_per_batch_size: fewer drafts at the larger batch, on both runners
    # with their graphs (ours' draft graphs are captured for the largest k). Only the runner's
    # own engines are started (the runner halves run as separate pytest processes).
    results = request.getfixturevalue("runs" if runner == "V1" else "v2_runs")
    plain, ours = results["tiny-plain-batched"], results["tiny-dynamic-k"]
    assert ours.token_ids == plain.token_ids
    metrics = ours.spec_metrics
    drafts = metrics["vllm:spec_decode_num_drafts"]
    assert drafts < metrics["vllm:spec_decode_num_draft_tokens"] < 3 * drafts  # both k ran


@on_gpu
@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_lossless_as_requests_come_and_go(request, runner: str) -> None:  # type: ignore[no-untyped-def]
    # Batches one after another in one engine: each request takes a slot (V2's request state
    # index, its KV blocks) that an earlier request of another length left. Nothing of the
    # earlier one may reach it. On the H200 (eleventh session) V2's verification graphs read
    # the prefill lengths through a pointer baked in at capture, one buffer of a ring V2
    # rotates at every update: from an engine's second batch on, requests shorter than their
    # slot's earlier occupant lost verified tokens, and the output left plain decoding's.
    results = request.getfixturevalue("runs" if runner == "V1" else "v2_runs")
    plain, ours = results["tiny-plain"], results["tiny-ours-again"]
    assert ours.token_ids == [plain.token_ids[i] for i in AGAIN_ORDER]
    assert ours.spec_metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    if runner == "V2":
        assert ours.greedy_verify_graphed > 0


@on_gpu
def test_v2_synthetic_acceptance_through_our_greedy_verification(v2_runs) -> None:  # type: ignore[no-untyped-def]
    # With vLLM's synthetic acceptance our verification runs (it draws as V2 does), and the
    # drafts are kept by position at about the configured unconditional rates: the counters
    # follow the profile, not the drafts (random-ish tiny weights accept far less by argmax).
    ours = v2_runs["tiny-synthetic"]
    assert ours.greedy_verify_batches > 0
    metrics = ours.spec_metrics
    drafts = metrics["vllm:spec_decode_num_drafts"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    rates = [n / drafts for n in per_pos]
    assert drafts > 50
    for got, want in zip(rates, SYNTHETIC_RATES, strict=True):
        assert abs(got - want) < 0.2, (rates, SYNTHETIC_RATES)
    # Its kernel's synthetic variant was compiled at start-up, for the argument types V2
    # passes: nothing of ours compiles in a request (vLLM's warm-up never verifies greedily).
    ours_compiled = [k for k in ours.triton_compiles if "_verify_rows_kernel" in k]
    assert ours_compiled == [], ours_compiled
