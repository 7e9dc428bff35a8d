"""The centroid-masked argmax and logits against their plain torch reference (the spec)."""

import pytest
import torch

from gemma4_spec.ops.centroid_argmax import (
    candidate_tokens,
    centroid_argmax,
    centroid_argmax_reference,
    masked_logits,
    masked_logits_reference,
)


def _head(
    vocab: int = 512, centroids: int = 32, d: int = 24, seed: int = 0, dtype=torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, d, generator=gen, dtype=dtype)
    centroid_w = torch.randn(centroids, d, generator=gen, dtype=dtype)
    ordering = torch.randperm(vocab, generator=gen)
    return lm_head, centroid_w, ordering


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("top_k", [1, 4, 32])
def test_argmax_matches_reference(num_tokens: int, top_k: int) -> None:
    lm_head, centroid_w, ordering = _head()
    hidden = torch.randn(num_tokens, lm_head.shape[1], dtype=lm_head.dtype)
    got = centroid_argmax(hidden, lm_head, centroid_w, ordering, top_k)
    want = centroid_argmax_reference(hidden, lm_head, centroid_w, ordering, top_k)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


def test_argmax_is_within_selected_centroids_and_differs_from_full_vocab() -> None:
    lm_head, centroid_w, ordering = _head(seed=1)
    hidden = torch.randn(256, lm_head.shape[1], dtype=lm_head.dtype)
    got = centroid_argmax(hidden, lm_head, centroid_w, ordering, top_k=2)
    candidates = candidate_tokens(hidden, centroid_w, ordering, top_k=2)
    assert (candidates == got[:, None]).any(dim=1).all()
    # With 2 of 32 centroids the mask must matter for some tokens, or this test proves nothing.
    full = (hidden @ lm_head.t()).argmax(dim=-1)
    assert (full != got).any()


def test_all_centroids_selected_equals_full_vocab_argmax() -> None:
    lm_head, centroid_w, ordering = _head(seed=2)
    hidden = torch.randn(40, lm_head.shape[1], dtype=lm_head.dtype)
    got = centroid_argmax(hidden, lm_head, centroid_w, ordering, top_k=centroid_w.shape[0])
    assert torch.equal(got, (hidden @ lm_head.t()).argmax(dim=-1))


def test_ties_go_to_the_smallest_token_id() -> None:
    # Integer-valued float64 data: every dot product is exact, so ties are exact.
    vocab, d = 64, 4
    lm_head = torch.zeros(vocab, d, dtype=torch.float64)
    lm_head[[9, 40, 17]] = torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    centroid_w = torch.eye(8, d, dtype=torch.float64)
    ordering = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    hidden = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    top_k = 8  # every token is a candidate; 9, 17 and 40 tie at 3.0
    assert centroid_argmax(hidden, lm_head, centroid_w, ordering, top_k).item() == 9
    assert centroid_argmax_reference(hidden, lm_head, centroid_w, ordering, top_k).item() == 9


def test_suppressed_tokens_are_never_drafted() -> None:
    lm_head, centroid_w, ordering = _head(seed=4)
    hidden = torch.randn(32, lm_head.shape[1], dtype=lm_head.dtype)
    first = centroid_argmax(hidden, lm_head, centroid_w, ordering, top_k=4)
    suppressed = first.unique()
    got = centroid_argmax(hidden, lm_head, centroid_w, ordering, 4, suppressed)
    want = centroid_argmax_reference(hidden, lm_head, centroid_w, ordering, 4, suppressed)
    assert torch.equal(got, want)
    assert not torch.isin(got, suppressed).any()


@pytest.mark.parametrize("with_suppressed", [False, True])
def test_masked_logits_match_reference(with_suppressed: bool) -> None:
    lm_head, centroid_w, ordering = _head(seed=5)
    hidden = torch.randn(9, lm_head.shape[1], dtype=lm_head.dtype)
    suppressed = torch.tensor([0, 1, 100]) if with_suppressed else None
    got = masked_logits(hidden, lm_head, centroid_w, ordering, 4, suppressed)
    want = masked_logits_reference(hidden, lm_head, centroid_w, ordering, 4, suppressed)
    assert got.shape == (9, lm_head.shape[0])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    # 4 centroids x 16 tokens each are scored, minus suppressed ones.
    assert (finite.sum(dim=1) <= 4 * 16).all() and (finite.sum(dim=1) >= 4 * 16 - 3).all()


def test_float32_argmax_agrees_with_reference_logit_value() -> None:
    # In float32 the sparse and dense dot products may round differently; the chosen token's
    # reference logit must still be the maximum up to rounding.
    lm_head, centroid_w, ordering = _head(vocab=2048, centroids=64, d=64, dtype=torch.float32)
    hidden = torch.randn(128, 64)
    got = centroid_argmax(hidden, lm_head, centroid_w, ordering, top_k=8)
    ref_logits = masked_logits_reference(hidden, lm_head, centroid_w, ordering, top_k=8)
    chosen = ref_logits.gather(1, got[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, ref_logits.max(dim=1).values, rtol=1e-5, atol=1e-5)
