"""The E4B, 26B-A4B and 31B-shaped tiny pairs (``gemma4_spec.testing.families``) on a CUDA GPU
with CUDA graphs, float32: greedy speculative decoding with our plugin gives exactly the tokens
of decoding without speculation, on Model Runner V2 (the plugin's default GPU runner) and on the
V1 runner (our proposer, its whole-loop draft graphs). The no-centroid assistants (26B-A4B, 31B)
draft through the full-vocabulary argmax kernel (``ops/vocab_argmax_triton.py``).

vLLM's own V1 path is reported to crash at start-up on the 26B-A4B pair ("a and b must have same
reduction dim", vllm#48848); ``test_in_tree_v1_on_26b`` runs it on the tiny 26B shape and
reports what it does, beside ours, which must run.

Skipped without CUDA (CI and the CPU machines); run on the GPU machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gemma4_spec.testing.engine_run import (
    PLUGIN_DRAFT_MODEL,
    RunConfig,
    RunResult,
    generate_in_subprocess,
    gpu_run_fields,
)
from gemma4_spec.testing.families import FAMILIES, build_family_pair
from gemma4_spec.testing.kv_norms import add_missing_k_norms

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT_LENGTHS = (5, 21, 33, 40)
MAX_TOKENS = 32
K = 3
RUNNERS = {"V1": "0", "V2": "1"}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("gpu-families")
    pairs = {family: build_family_pair(family, root / family) for family in FAMILIES}
    for target, _ in pairs.values():
        add_missing_k_norms(target)  # vLLM 0.26 wants one on the KV-shared layers too
    return pairs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4321)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]


def _config(target: Path, prompts: list[list[int]], assistant: Path | None) -> RunConfig:
    return RunConfig(
        **gpu_run_fields(str(target), prompts, MAX_TOKENS),
        assistant=None if assistant is None else str(assistant),
        num_speculative_tokens=K,
    )


def _on_runner(
    runner: str, configs: list[RunConfig], plugins: str | None = None
) -> list[RunResult]:
    """Engines on one model runner, in a process of their own (vLLM 0.26 keeps graph state a
    V1 engine leaves unfit for a later V2 one)."""
    return generate_in_subprocess(
        configs, plugins=plugins, env={"VLLM_USE_V2_MODEL_RUNNER": RUNNERS[runner]}
    )


class _Runs:
    """Plain and ours on one family's pair and one runner, each (family, runner) in a process of
    its own, run when a test first asks for it: an engine that fails at start-up on one shape
    fails that shape's tests only (the others still give their verdict), and ``-k`` starts only
    the engines the selected tests need."""

    def __init__(self, pairs: dict[str, tuple[Path, Path]], prompts: list[list[int]]) -> None:
        self._pairs = pairs
        self._prompts = prompts
        self._done: dict[tuple[str, str], tuple[RunResult, RunResult] | RuntimeError] = {}

    def of(self, family: str, runner: str) -> tuple[RunResult, RunResult]:
        """(plain, ours)."""
        key = (family, runner)
        if key not in self._done:
            target, assistant = self._pairs[family]
            configs = [
                _config(target, self._prompts, None),
                _config(target, self._prompts, assistant),
            ]
            try:
                plain, ours = _on_runner(runner, configs)
                self._done[key] = (plain, ours)
            except RuntimeError as failure:  # kept: a second test asking fails the same way
                self._done[key] = failure
        done = self._done[key]
        if isinstance(done, RuntimeError):
            raise done
        return done


@pytest.fixture(scope="module")
def runs(pairs: dict[str, tuple[Path, Path]], prompts: list[list[int]]) -> _Runs:
    return _Runs(pairs, prompts)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_no_speculation(runs: _Runs, family: str, runner: str) -> None:
    plain, ours = runs.of(family, runner)
    assert ours.draft_model_class == PLUGIN_DRAFT_MODEL
    assert ours.token_ids == plain.token_ids
    assert all(len(tokens) == MAX_TOKENS for tokens in ours.token_ids)
    metrics = ours.spec_metrics
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_in_tree_v1_on_26b(
    pairs: dict[str, tuple[Path, Path]],
    prompts: list[list[int]],
    runs: _Runs,
    report_figure: Callable[[str], None],
) -> None:
    # Ours on the V1 runner starts and is lossless on this pair (the test above); vLLM's own V1
    # path is run here for the record: whether it starts, and how it fails if it does not.
    plain, ours = runs.of("26b-a4b", "V1")
    assert ours.token_ids == plain.token_ids
    target, assistant = pairs["26b-a4b"]
    try:
        (in_tree,) = _on_runner("V1", [_config(target, prompts, assistant)], plugins="none")
    except RuntimeError as failure:
        tail = str(failure).strip().splitlines()[-3:]
        report_figure(f"in-tree V1 on the tiny 26B-A4B shape did not start: {tail}")
        return
    same = in_tree.token_ids == plain.token_ids
    report_figure(f"in-tree V1 on the tiny 26B-A4B shape started; tokens equal to plain: {same}")
