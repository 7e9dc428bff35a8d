"""Centroid-masked logits and greedy argmax of a Gemma 4 assistant.

A Gemma 4 assistant with ``use_ordered_embeddings`` scores only part of its vocabulary:
the final hidden state ``h`` is projected to ``num_centroids`` scores, the best ``top_k``
centroids are kept, and ``token_ordering`` (a permutation of the vocabulary viewed as
``[num_centroids, vocab // num_centroids]``) names the tokens of each centroid. Only those
``top_k * vocab // num_centroids`` tokens get a logit; every other token is masked out.

``masked_logits_reference`` is the definition: full-vocabulary logits with the unselected
(and suppressed) tokens at ``-inf``. Greedy drafting only needs the argmax, so
``centroid_argmax`` computes it from the selected rows of the lm_head alone, without any
``[tokens, vocab]`` tensor. Ties go to the smallest token id, exactly like ``argmax`` of the
reference (PyTorch returns the first maximal index).
"""

from __future__ import annotations

import torch


def select_centroids(
    hidden: torch.Tensor, centroids_weight: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Ids of the ``top_k`` best-scoring centroids per token: ``[T, top_k]``."""
    scores = hidden @ centroids_weight.t()
    return torch.topk(scores, k=top_k, dim=-1).indices


def candidate_tokens(
    hidden: torch.Tensor,
    centroids_weight: torch.Tensor,
    token_ordering: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Vocabulary ids of the tokens in each token's selected centroids: ``[T, top_k * C]``
    where ``C = vocab // num_centroids``."""
    num_centroids = centroids_weight.shape[0]
    clusters = token_ordering.view(num_centroids, -1)
    chosen = select_centroids(hidden, centroids_weight, top_k)
    return clusters[chosen].flatten(1)


def masked_logits_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    centroids_weight: torch.Tensor,
    token_ordering: torch.Tensor,
    top_k: int,
    suppressed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition: full-vocab logits ``[T, V]``, ``-inf`` outside the selected centroids
    and on ``suppressed`` token ids. Plain torch, materialises everything."""
    logits = hidden @ lm_head_weight.t()
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(1, candidate_tokens(hidden, centroids_weight, token_ordering, top_k), True)
    if suppressed is not None and suppressed.numel() > 0:
        keep[:, suppressed] = False
    return logits.masked_fill(~keep, float("-inf"))


def centroid_argmax_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    centroids_weight: torch.Tensor,
    token_ordering: torch.Tensor,
    top_k: int,
    suppressed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy draft tokens by definition: ``argmax`` of the reference masked logits."""
    return masked_logits_reference(
        hidden, lm_head_weight, centroids_weight, token_ordering, top_k, suppressed
    ).argmax(dim=-1)


def masked_logits(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    centroids_weight: torch.Tensor,
    token_ordering: torch.Tensor,
    top_k: int,
    suppressed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-vocab masked logits, computing dot products for the selected tokens only.

    Used where a distribution over the vocabulary is needed (probabilistic drafting);
    equal to ``masked_logits_reference``."""
    candidates = candidate_tokens(hidden, centroids_weight, token_ordering, top_k)
    scores = _candidate_scores(hidden, lm_head_weight, candidates)
    if suppressed is not None and suppressed.numel() > 0:
        scores = scores.masked_fill(torch.isin(candidates, suppressed), float("-inf"))
    out = hidden.new_full((hidden.shape[0], lm_head_weight.shape[0]), float("-inf"))
    return out.scatter_(1, candidates, scores)


def centroid_argmax(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    centroids_weight: torch.Tensor,
    token_ordering: torch.Tensor,
    top_k: int,
    suppressed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy draft tokens ``[T]`` (int64) without a full-vocab tensor.

    Reads the ``top_k * C`` selected lm_head rows per token, scores them, and keeps the best,
    breaking ties towards the smallest token id so the result equals
    ``centroid_argmax_reference``."""
    candidates = candidate_tokens(hidden, centroids_weight, token_ordering, top_k)
    scores = _candidate_scores(hidden, lm_head_weight, candidates)
    if suppressed is not None and suppressed.numel() > 0:
        scores = scores.masked_fill(torch.isin(candidates, suppressed), float("-inf"))
    best = scores.max(dim=-1, keepdim=True).values
    vocab_size = lm_head_weight.shape[0]
    # Among the tokens reaching the best score, the smallest id wins (as in argmax).
    tied = torch.where(scores == best, candidates, torch.full_like(candidates, vocab_size))
    return tied.min(dim=-1).values


def _candidate_scores(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """Dot products of each token's hidden state with its candidate lm_head rows: ``[T, S]``."""
    rows = lm_head_weight[candidates]  # [T, S, d]
    return torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
