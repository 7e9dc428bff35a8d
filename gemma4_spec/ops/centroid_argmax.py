"""Centroid-masked logits and greedy argmax of a Gemma 4 assistant.

A Gemma 4 assistant with ``use_ordered_embeddings`` scores only part of its vocabulary:
the final hidden state ``h`` is projected to ``num_centroids`` scores, the best ``top_k``
centroids are kept, and ``token_ordering`` (a permutation of the vocabulary viewed as
``[num_centroids, vocab // num_centroids]``) names the tokens of each centroid. Only those
``top_k * vocab // num_centroids`` tokens get a logit; every other token is masked out, and so
are the ``suppressed`` tokens of the assistant's generation config.

``masked_logits_reference`` is the definition: full-vocabulary logits with the masked tokens at
``-inf``. Greedy drafting only needs the argmax, so ``centroid_argmax`` computes it from the
selected rows of the lm_head alone, without any ``[tokens, vocab]`` tensor. Ties go to the
smallest token id, exactly like ``argmax`` of the reference (PyTorch returns the first maximal
index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CentroidMask:
    """What decides which tokens of the vocabulary an assistant scores."""

    centroids_weight: torch.Tensor  # [num_centroids, d]
    token_ordering: torch.Tensor  # [vocab], a permutation
    top_k: int
    suppressed: torch.Tensor | None = None  # token ids never drafted

    def candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of the tokens in each token's top-k centroids: ``[T, top_k * C]``,
        ``C = vocab // num_centroids``."""
        chosen = torch.topk(hidden @ self.centroids_weight.t(), k=self.top_k, dim=-1).indices
        clusters = self.token_ordering.view(self.centroids_weight.shape[0], -1)
        return clusters[chosen].flatten(1)

    def has_suppressed(self) -> bool:
        return self.suppressed is not None and self.suppressed.numel() > 0


def masked_logits_reference(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> torch.Tensor:
    """The definition: full-vocab logits ``[T, V]``, ``-inf`` outside the selected centroids
    and on suppressed tokens. Plain torch, materialises everything."""
    logits = hidden @ lm_head_weight.t()
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(1, mask.candidates(hidden), True)
    if mask.has_suppressed():
        keep[:, mask.suppressed] = False
    return logits.masked_fill(~keep, float("-inf"))


def centroid_argmax_reference(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> torch.Tensor:
    """Greedy draft tokens by definition: ``argmax`` of the reference masked logits."""
    return masked_logits_reference(hidden, lm_head_weight, mask).argmax(dim=-1)


def masked_logits(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> torch.Tensor:
    """Full-vocab masked logits, with dot products for the selected tokens only.

    Used where a distribution over the vocabulary is needed (probabilistic drafting); equal to
    ``masked_logits_reference``."""
    candidates, scores = _scored_candidates(hidden, lm_head_weight, mask)
    out = hidden.new_full((hidden.shape[0], lm_head_weight.shape[0]), float("-inf"))
    return out.scatter_(1, candidates, scores)


def centroid_argmax(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> torch.Tensor:
    """Greedy draft tokens ``[T]`` (int64) without a full-vocab tensor.

    Reads the ``top_k * C`` selected lm_head rows per token, scores them, and keeps the best,
    breaking ties towards the smallest token id so the result equals
    ``centroid_argmax_reference``."""
    candidates, scores = _scored_candidates(hidden, lm_head_weight, mask)
    best = scores.max(dim=-1, keepdim=True).values
    beyond_vocab = torch.full_like(candidates, lm_head_weight.shape[0])
    return torch.where(scores == best, candidates, beyond_vocab).min(dim=-1).values


def _scored_candidates(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, mask: CentroidMask
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's candidate ids ``[T, S]`` and their logits ``[T, S]`` (suppressed: -inf)."""
    candidates = mask.candidates(hidden)
    rows = lm_head_weight[candidates]  # [T, S, d]
    scores = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
    if mask.has_suppressed():
        scores = scores.masked_fill(torch.isin(candidates, mask.suppressed), float("-inf"))
    return candidates, scores
