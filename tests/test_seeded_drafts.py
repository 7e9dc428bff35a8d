"""Seeded requests under probabilistic drafting (``spec_decode/seeded_drafts.py``): their rows
become the greedy draft with a one-hot probability, every other row is left as sampled."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.spec_decode.seeded_drafts import one_hot_drafts


def test_seeded_rows_become_one_hot_greedy_drafts() -> None:
    probs = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(0)), -1)
    tokens = torch.tensor([3, 1, 4, 1])
    sampled_probs = probs.clone()
    got_tokens, got_probs = one_hot_drafts(tokens, probs, [1, 3], torch.tensor([7, 2]))
    assert got_tokens.tolist() == [3, 7, 4, 2]
    assert torch.equal(got_probs[[0, 2]], sampled_probs[[0, 2]])  # unseeded rows as sampled
    assert got_probs[1].tolist() == [0.0] * 7 + [1.0] + [0.0] * 2
    assert got_probs[3].nonzero().flatten().tolist() == [2] and float(got_probs[3, 2]) == 1.0


def test_no_seeded_rows_and_bad_input() -> None:
    tokens, probs = torch.tensor([5]), torch.full((1, 8), 0.125)
    assert one_hot_drafts(tokens, probs, [], torch.empty(0, dtype=torch.long))[0].tolist() == [5]
    with pytest.raises(ValueError, match="greedy drafts"):
        one_hot_drafts(tokens, probs, [0], torch.tensor([1, 2]))
