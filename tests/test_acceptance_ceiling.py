"""The acceptance formulas of ``benchmarks/acceptance_ceiling.py`` (issue 16's offline figures).

Hand-worked distributions: the speculative-sampling acceptance sum_x min(p, q) and a greedy
draft's p(argmax q), the k-step expected accepted count, and the target distribution's top-k /
top-p against transformers' own warpers (the same rule as vLLM's sampler)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import acceptance_ceiling as ac  # noqa: E402


def test_identical_distributions_always_accept() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert torch.allclose(ac.probabilistic_acceptance(p, p), torch.ones(2))


def test_disjoint_supports_never_accept() -> None:
    p = torch.tensor([0.6, 0.4, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.7, 0.3])
    assert float(ac.probabilistic_acceptance(p, q)) == 0.0
    assert float(ac.greedy_acceptance(p, q.argmax(-1))) == 0.0


def test_hand_worked_greedy_vs_probabilistic() -> None:
    # Target p = (0.4, 0.35, 0.25), draft q = (0.5, 0.3, 0.2). Greedy drafts x = 0 and is
    # accepted with p(0) = 0.4. Sampling x ~ q: sum min = 0.4 + 0.3 + 0.2 = 0.9
    # (= 1 - TV(p, q) = 1 - 0.1).
    p = torch.tensor([0.4, 0.35, 0.25])
    q = torch.tensor([0.5, 0.3, 0.2])
    assert float(ac.greedy_acceptance(p, q.argmax(-1))) == pytest.approx(0.4)
    assert float(ac.probabilistic_acceptance(p, q)) == pytest.approx(0.9)
    assert float(ac.probabilistic_acceptance(p, q)) == pytest.approx(
        1 - 0.5 * float((p - q).abs().sum())
    )


def test_probabilistic_equals_monte_carlo_acceptance() -> None:
    # The formula is the probability that the verification test min(1, p(x)/q(x)) >= u passes
    # for x ~ q: check it against draws.
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(16, generator=gen), -1)
    q = torch.softmax(torch.randn(16, generator=gen) * 2, -1)
    draws = torch.multinomial(q, 200_000, replacement=True, generator=gen)
    accept = torch.rand(draws.shape, generator=gen) < (p[draws] / q[draws]).clamp(max=1.0)
    assert float(accept.float().mean()) == pytest.approx(
        float(ac.probabilistic_acceptance(p, q)), abs=0.005
    )


def test_temperature_zero_is_one_hot_and_both_methods_agree() -> None:
    target_logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    draft_logits = torch.tensor([[0.0, 4.0, 1.0], [2.0, 0.0, 1.0]])
    p = ac.target_probs(target_logits, 0.0)
    q = ac.draft_probs(draft_logits, 0.0)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    expected = torch.tensor([1.0, 0.0])  # row 0 drafts the target's token, row 1 does not
    assert torch.equal(ac.probabilistic_acceptance(p, q), expected)
    assert torch.equal(ac.greedy_acceptance(p, draft_logits.argmax(-1)), expected)


def test_masked_draft_logits_give_zero_probability_off_the_mask() -> None:
    logits = torch.tensor([2.0, float("-inf"), 1.0, float("-inf")])
    q = ac.draft_probs(logits, 1.0)
    assert q[1] == 0.0 and q[3] == 0.0
    assert float(q.sum()) == pytest.approx(1.0)
    # A target with all its mass off the mask can accept nothing from such a draft.
    p = torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert float(ac.probabilistic_acceptance(p, q)) == 0.0


def test_expected_accepted_multiplies_along_the_steps() -> None:
    acceptance = torch.tensor([[0.5, 0.4, 0.2], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    expected = torch.tensor([0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.2, 3.0, 0.0])
    assert torch.allclose(ac.expected_accepted(acceptance), expected)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (5, 1.0), (5, 0.8), (64, 0.95)])
def test_target_top_k_top_p_match_transformers(top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=gen) * 3
    temperature = 0.6
    scaled = logits / temperature
    if top_k:
        scaled = TopKLogitsWarper(top_k)(None, scaled)
    if top_p < 1.0:
        scaled = TopPLogitsWarper(top_p)(None, scaled)
    expected = scaled.softmax(-1)
    assert torch.allclose(ac.target_probs(logits, temperature, top_k, top_p), expected)


def test_top_p_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]])  # p(0) ~ 0.99991 > top_p
    probs = ac.target_probs(logits, 1.0, top_p=0.5)
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0]]))


def test_simulated_loop_at_temperature_zero_matches_the_per_position_figures() -> None:
    # At temperature 0 both computations are deterministic and must agree exactly: the Monte
    # Carlo replica of the decoding loop reproduces the target's greedy continuation token for
    # token, and at each cycle it accepts as many drafts as the per-position computation's
    # leading run of agreements at that anchor (teacher forcing is exact when every accepted
    # draft is the continuation's token). A wrong draft input or anchor in either breaks this.
    from transformers import AutoTokenizer

    from gemma4_spec.testing.tiny import load_hf_pair

    k, new_tokens = 3, 24
    target_dir, assistant_dir = ac.tiny_gsm8k_pair()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [ac.prompt_ids(tokenizer, q) for q in ac.gsm8k_questions(2)]
    target, assistant = load_hf_pair(target_dir, assistant_dir)
    greedy = ac.Setting("T=0", 0.0)
    # k + 1 tokens more, so that every anchor the loop visits has all its k drafts evaluated.
    reference = ac.sample_continuations(target, prompts, greedy, new_tokens + k + 1, seed=0)
    assert all(len(c) == new_tokens + k + 1 for c in reference)  # no end token in the window
    agree = ac.per_position(ac.draft_outputs(target, assistant, prompts, reference, k), greedy)
    agree_rows = agree[ac.AGREE].split(new_tokens + 1)  # positions L-1 .. L-1+24 per question

    expected_counts = [0] * k
    for rows in agree_rows:
        offset = 0  # anchor - (L - 1)
        while offset < new_tokens - 1:
            accepted = int(rows[offset].cumprod(0).sum())
            for s in range(accepted):
                expected_counts[s] += 1
            offset += accepted + 1
    for method in ("greedy", "probabilistic"):
        counts = ac.LoopCounts()
        gen = torch.Generator().manual_seed(0)
        for prompt, expected in zip(prompts, reference, strict=True):
            tokens = ac.simulate_decoding(
                target, assistant, prompt, greedy, method, k, new_tokens, gen, counts
            )
            assert tokens == expected[:new_tokens]
        assert counts.accepted_per_position == expected_counts
    assert expected_counts[0] > 0
