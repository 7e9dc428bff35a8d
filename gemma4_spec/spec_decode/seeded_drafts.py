"""Probabilistic drafting for seeded requests: a greedy draft with a one-hot probability.

vLLM's probabilistic drafting (``draft_sample_method: "probabilistic"``) draws every draft
token with the process's global random generator, also for a request with its own ``seed``;
the verification then depends on those draws, so a seeded request would not repeat its text.
A deterministic draft is as valid a proposal as a sampled one, as long as the rejection sampler
is told its probability: one on the drafted token, zero elsewhere. So the rows of seeded
requests get the greedy draft and that one-hot distribution; the output keeps the target's
distribution (speculative sampling is exact for any proposal) and repeats for a fixed seed.
"""

from __future__ import annotations

import torch


def one_hot_drafts(
    tokens: torch.Tensor, probs: torch.Tensor, rows: list[int], greedy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` ``[B]`` and ``probs`` ``[B, V]`` with each row in ``rows`` replaced by its
    greedy draft (``greedy[i]`` for ``rows[i]``) and a one-hot probability (in place)."""
    if len(rows) != greedy.shape[0]:
        raise ValueError(f"one_hot_drafts: {len(rows)} rows, {greedy.shape[0]} greedy drafts")
    if not rows:
        return tokens, probs
    index = torch.tensor(rows, dtype=torch.long, device=tokens.device)
    greedy = greedy.to(device=tokens.device, dtype=tokens.dtype)
    tokens[index] = greedy
    probs[index] = 0
    probs[index, greedy.long()] = 1
    return tokens, probs
