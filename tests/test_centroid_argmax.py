"""The centroid-masked argmax and logits against their plain torch reference (the spec)."""

import pytest
import torch

from gemma4_spec.ops.centroid_argmax import (
    CentroidMask,
    centroid_argmax,
    centroid_argmax_reference,
    masked_logits,
    masked_logits_reference,
)


def _head(
    top_k: int,
    vocab: int = 512,
    centroids: int = 32,
    d: int = 24,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, CentroidMask]:
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, d, generator=gen, dtype=dtype)
    centroid_w = torch.randn(centroids, d, generator=gen, dtype=dtype)
    ordering = torch.randperm(vocab, generator=gen)
    return lm_head, CentroidMask(centroid_w, ordering, top_k)


def _hidden(num_tokens: int, lm_head: torch.Tensor, seed: int = 100) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, lm_head.shape[1], generator=gen, dtype=lm_head.dtype)


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("top_k", [1, 4, 32])
def test_argmax_matches_reference(num_tokens: int, top_k: int) -> None:
    lm_head, mask = _head(top_k)
    hidden = _hidden(num_tokens, lm_head)
    got = centroid_argmax(hidden, lm_head, mask)
    assert got.dtype == torch.int64
    assert torch.equal(got, centroid_argmax_reference(hidden, lm_head, mask))


def test_argmax_is_within_selected_centroids_and_differs_from_full_vocab() -> None:
    lm_head, mask = _head(top_k=2, seed=1)
    hidden = _hidden(256, lm_head)
    got = centroid_argmax(hidden, lm_head, mask)
    assert (mask.candidates(hidden) == got[:, None]).any(dim=1).all()
    # With 2 of 32 centroids the mask must matter for some tokens, or this test proves nothing.
    assert ((hidden @ lm_head.t()).argmax(dim=-1) != got).any()


def test_all_centroids_selected_equals_full_vocab_argmax() -> None:
    lm_head, mask = _head(top_k=32, seed=2)
    hidden = _hidden(40, lm_head)
    assert torch.equal(
        centroid_argmax(hidden, lm_head, mask), (hidden @ lm_head.t()).argmax(dim=-1)
    )


def test_ties_go_to_the_smallest_token_id() -> None:
    # Integer-valued float64 data: every dot product is exact, so ties are exact.
    vocab, d = 64, 4
    lm_head = torch.zeros(vocab, d, dtype=torch.float64)
    lm_head[[9, 40, 17]] = torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    ordering = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    # All 8 centroids selected: every token is a candidate; 9, 17 and 40 tie at 3.0.
    mask = CentroidMask(torch.eye(8, d, dtype=torch.float64), ordering, top_k=8)
    hidden = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    assert centroid_argmax(hidden, lm_head, mask).item() == 9
    assert centroid_argmax_reference(hidden, lm_head, mask).item() == 9


def test_suppressed_tokens_are_never_drafted() -> None:
    lm_head, mask = _head(top_k=4, seed=4)
    hidden = _hidden(32, lm_head)
    suppressed = centroid_argmax(hidden, lm_head, mask).unique()
    mask = CentroidMask(mask.centroids_weight, mask.token_ordering, mask.top_k, suppressed)
    got = centroid_argmax(hidden, lm_head, mask)
    assert torch.equal(got, centroid_argmax_reference(hidden, lm_head, mask))
    assert not torch.isin(got, suppressed).any()


@pytest.mark.parametrize("with_suppressed", [False, True])
def test_masked_logits_match_reference(with_suppressed: bool) -> None:
    lm_head, mask = _head(top_k=4, seed=5)
    if with_suppressed:
        mask = CentroidMask(mask.centroids_weight, mask.token_ordering, 4, torch.tensor([0, 1, 9]))
    hidden = _hidden(9, lm_head)
    got = masked_logits(hidden, lm_head, mask)
    want = masked_logits_reference(hidden, lm_head, mask)
    assert got.shape == (9, lm_head.shape[0])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    # 4 centroids x 16 tokens each are scored, less the suppressed ones among them.
    assert (finite.sum(dim=1) <= 4 * 16).all() and (finite.sum(dim=1) >= 4 * 16 - 3).all()


def test_float32_argmax_agrees_with_reference_logit_value() -> None:
    # In float32 the sparse and dense dot products may round differently; the chosen token's
    # reference logit must still be the maximum up to rounding.
    lm_head, mask = _head(top_k=8, vocab=2048, centroids=64, d=64, dtype=torch.float32)
    hidden = _hidden(128, lm_head)
    got = centroid_argmax(hidden, lm_head, mask)
    ref_logits = masked_logits_reference(hidden, lm_head, mask)
    chosen = ref_logits.gather(1, got[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, ref_logits.max(dim=1).values, rtol=1e-5, atol=1e-5)


def test_candidates_hand_worked() -> None:
    # 8 tokens in 4 centroids of 2: the ordering lists centroid 0's tokens first, then 1's...
    ordering = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # 0: {5, 2}, 1: {7, 0}, 2: {3, 6}, 3: {1, 4}
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    mask = CentroidMask(centroids, ordering, top_k=2)
    hidden = torch.tensor([[2.0, 1.0], [-1.0, -3.0]])  # top-2 centroids: (0, 1), then (3, 2)
    assert mask.candidates(hidden).tolist() == [[5, 2, 7, 0], [1, 4, 3, 6]]


def test_masked_logits_reference_agrees_with_the_fp32_reference() -> None:
    # Two references written apart (the candidates' ids against a token -> centroid map) must
    # keep the same tokens.
    from gemma4_spec.ops.centroid_argmax_triton import masked_logits_fp32_reference

    lm_head, mask = _head(top_k=4, seed=6)
    mask = CentroidMask(mask.centroids_weight, mask.token_ordering, 4, torch.tensor([0, 1, 9]))
    hidden = _hidden(16, lm_head)
    ours = masked_logits_reference(hidden, lm_head, mask)
    fp32 = masked_logits_fp32_reference(hidden, lm_head, mask)
    assert torch.equal(torch.isinf(ours), torch.isinf(fp32))
