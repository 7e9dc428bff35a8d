"""The rejection step keeps the target's sampling distribution, at every position it decides.

vLLM's ``RejectionSampler`` (with our patches, as the plugin applies them) verifies a batch of
many identical requests: fixed target logits for the ``k`` draft rows and the bonus row, fixed
drafts (greedy drafting: no draft probabilities, as our proposer gives). Speculative sampling
promises that, given the first ``j`` output tokens equal the first ``j`` drafts, the token at
position ``j`` follows the target distribution of row ``j`` after temperature, top-k and top-p;
each position's histogram is tested against that distribution (computed here, independently of
vLLM) with a chi-square goodness-of-fit test. The batch mixes requests at temperature 1.0, at
0.6 with top_p 0.95 and top_k 64, and greedy ones (which must give the argmax rows and keep our
greedy-verification shortcut off). The negative controls run the same check on a sampler that
accepts drafts too often (as if their draft probability were 0.8, not 1), at every position and
at the later positions only: both must fail.

Determinism and flakes: the global torch seed is fixed, so every run draws the same numbers and
the test passes or fails the same way each time; the threshold is also Bonferroni-corrected
(``ALPHA`` over the number of histograms tested), so a seed change flakes with probability
below ``ALPHA``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from gemma4_spec.testing.chi_square import ChiSquare, goodness_of_fit
from gemma4_spec.testing.verify_step import (
    greedy_sampling_metadata,
    rejection_samplers,
    spec_decode_metadata,
)

VOCAB = 96
ALPHA = 1e-3
SAMPLES = 12_000  # requests of each sampled group, in CALLS forward calls
CALLS = 3
# Group name -> (temperature, top_p, top_k); top_k = VOCAB and top_p = 1 mean "off" in vLLM.
GROUPS = {"t1.0": (1.0, 1.0, VOCAB), "t0.6-p0.95-k64": (0.6, 0.95, 64), "greedy": (0.0, 1.0, VOCAB)}


def target_distribution(logits: torch.Tensor, temperature: float, top_p: float, top_k: int):
    """The distribution sampling must follow (rows of ``logits``), as vLLM defines it: scale by
    the temperature, keep the top_k largest, then drop the smallest tokens whose total
    probability stays within 1 - top_p (the most likely token always kept)."""
    scaled = logits.double() / temperature
    kth = scaled.topk(top_k, dim=-1).values[:, -1:]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    sorted_p, order = probs.sort(dim=-1)
    drop = sorted_p.cumsum(dim=-1) <= 1 - top_p
    drop[:, -1] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


# Target probability of each draft at temperature 1 in the "deep" inputs: every position is
# reached in hundreds of requests, and the most likely token stays above it (greedy rejects).
DRAFT_PROB = 0.38
# "broad": each draft the runner-up a little below the top token (about 1/6 of the probability
# at temperature 1), many tokens kept at temperature 0.6 / top_p 0.95: the filters' tails are
# tested, the last positions by few requests. "deep": drafts at DRAFT_PROB, every position by
# hundreds (at temperature 0.6 the two top tokens then hold over 95%: top_p keeps just them).
INPUTS = ("broad", "deep")


def _step_inputs(k: int, inputs: str = "broad") -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits of one request (``k`` draft rows and the bonus row) and its drafts, each
    draft the second most likely token (see INPUTS)."""
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 1.5
    order = logits.argsort(dim=-1, descending=True)
    drafts = order[:k, 1].to(torch.int32)
    for row in range(k):
        top, draft = int(order[row, 0]), int(drafts[row])
        if inputs == "broad":
            logits[row, draft] = logits[row, top] - 0.1
            continue
        rest = logits[row].clone()
        rest[[top, draft]] = float("-inf")
        # p(draft) = e^d / (e^d (1 + e^0.05) + e^rest) = DRAFT_PROB, solved for d.
        d = rest.logsumexp(0) - math.log(1 / DRAFT_PROB - 1 - math.exp(0.05))
        logits[row, draft], logits[row, top] = d, d + 0.05
    return logits, drafts


def _run(k: int, inputs: str, biased_from: int | None = None) -> dict[str, torch.Tensor]:
    """Output tokens ``[n, k + 1]`` of each group (-1 after a rejection); drafts from position
    ``biased_from`` on accepted too often (the negative controls)."""
    import vllm.v1.sample.ops.topk_topp_sampler as topk_module
    import vllm.v1.sample.rejection_sampler as rs

    from gemma4_spec.patch import patch_cpu_expand, patch_top_k_only

    patch_cpu_expand.apply(rs)  # as the plugin does in an engine (no-op where not needed)
    patch_top_k_only.apply(topk_module)
    sampler, _ = rejection_samplers()
    stats = sampler.gemma4_spec_greedy_verify
    logits, drafts = _step_inputs(k, inputs)
    per_call = SAMPLES // CALLS
    names = list(GROUPS)
    batch = per_call * len(names)
    group_of = torch.arange(batch) % len(names)  # groups interleaved through the batch
    params = torch.tensor([GROUPS[n] for n in names], dtype=torch.float64)[group_of]
    metadata = spec_decode_metadata([k] * batch, "cpu")
    metadata = dataclasses.replace(metadata, draft_token_ids=drafts.repeat(batch))
    sampling = greedy_sampling_metadata(
        batch,
        all_greedy=False,
        all_random=False,
        temperature=params[:, 0].float(),
        top_p=params[:, 1].float(),
        top_k=params[:, 2].to(torch.int32),
    )
    draft_probs = None
    if biased_from is not None:  # accepts a draft when p / 0.8 >= u: too often
        q = torch.where(torch.arange(k) >= biased_from, 0.8, 1.0)  # 1.0: exact, as greedy
        draft_probs = torch.zeros(batch * k, VOCAB)
        draft_probs[torch.arange(batch * k), drafts.repeat(batch).long()] = q.repeat(batch)
    torch.manual_seed(0)
    out = []
    for _ in range(CALLS):
        result = sampler(metadata, draft_probs, logits.repeat(batch, 1), sampling)
        out.append(result.sampled_token_ids)
    assert stats.batches == 0, "greedy-verification shortcut taken for a batch with sampled rows"
    tokens = torch.cat(out)
    group_of = group_of.repeat(CALLS)
    return {name: tokens[group_of == g] for g, name in enumerate(names)}


def _position_tests(
    tokens: torch.Tensor, k: int, group: str, inputs: str
) -> list[tuple[int, ChiSquare]]:
    logits, drafts = _step_inputs(k, inputs)
    probs = target_distribution(logits, *GROUPS[group])
    results = []
    reached = torch.ones(tokens.shape[0], dtype=torch.bool)
    for j in range(k + 1):
        results.append((j, goodness_of_fit(tokens[reached, j].tolist(), probs[j])))
        if j < k:
            reached &= tokens[:, j] == drafts[j]
    return results


# Requests that must reach every position of the "broad" and the "deep" inputs.
MIN_REACHED = {"broad": 50, "deep": 500}


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_step_keeps_the_distribution(
    k: int, inputs: str, report_figure: Callable[[str], None]
) -> None:
    runs = _run(k, inputs)
    logits, drafts = _step_inputs(k, inputs)
    greedy = runs["greedy"]
    argmax = logits.argmax(dim=-1)
    n_accepted = int((drafts == argmax[:k]).int().cumprod(0).sum())
    assert (greedy[:, 0] == argmax[0]).all()  # greedy rows: the argmax, drafts all rejected
    assert n_accepted == 0 and (greedy[:, 1:] == -1).all()
    tests = [
        (g, j, c)
        for g in ("t1.0", "t0.6-p0.95-k64")
        for j, c in _position_tests(runs[g], k, g, inputs)
    ]
    level = ALPHA / len(tests)
    for group, j, chi in tests:
        report_figure(f"k={k} {inputs} {group} position {j}: {chi}")
    failed = [(g, j, str(c)) for g, j, c in tests if c.p_value < level]
    assert not failed, f"distribution changed (p < {level:.1e}): {failed}"
    for group, _, chi in tests:
        assert chi.samples[0] >= MIN_REACHED[inputs], (group, chi)  # reached often enough


@pytest.mark.parametrize(("inputs", "biased_from"), [("broad", 0), ("deep", 1)])
def test_negative_control_biased_acceptance_fails(
    inputs: str, biased_from: int, report_figure: Callable[[str], None]
) -> None:
    """Drafts accepted too often at every position, and from the second draft on only: the
    test finds both (the second, at a position only requests that accepted a draft reach)."""
    k = 3
    runs = _run(k, inputs, biased_from)
    tests = [
        (j, c)
        for g in ("t1.0", "t0.6-p0.95-k64")
        for j, c in _position_tests(runs[g], k, g, inputs)
    ]
    level = ALPHA / len(tests)
    worst = min((c for j, c in tests if j >= biased_from), key=lambda c: c.p_value)
    report_figure(f"biased acceptance (q=0.8) from position {biased_from}, worst: {worst}")
    assert worst.p_value < level, f"the test did not notice a biased sampler: {worst}"
    if biased_from:  # the exact positions before the bias still pass
        assert all(c.p_value >= level for j, c in tests if j < biased_from), tests
