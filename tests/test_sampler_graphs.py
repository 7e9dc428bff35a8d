"""GraphedGreedySampler: replays captured sampling on CUDA, falls back to eager otherwise, and
gives the eager tokens either way. Also the GPU-benchmark checkpoint helpers (shapes only)."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax import CentroidMask, centroid_argmax_reference
from gemma4_spec.ops.centroid_argmax_triton import centroid_argmax_fused
from gemma4_spec.spec_decode.sampler_graphs import GraphedGreedySampler
from gemma4_spec.testing import e2b_shaped
from gemma4_spec.testing.kv_norms import add_missing_k_norms
from gemma4_spec.testing.tiny import build_tiny_e2b_like_target
from gemma4_spec.validation import validate_pair


def _head(device: str, vocab: int = 512, centroids: int = 16, d: int = 32):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(vocab, d, generator=gen).to(device)
    mask = CentroidMask(
        torch.randn(centroids, d, generator=gen).to(device),
        torch.randperm(vocab, generator=gen).to(device),
        4,
        torch.tensor([3, 7], device=device),
    )
    return lm_head, mask


def test_without_cuda_nothing_is_captured_and_tokens_are_eager() -> None:
    lm_head, mask = _head("cpu")
    sampler = GraphedGreedySampler(
        lambda h: centroid_argmax_fused(mask, h, lm_head), 32, torch.float32, torch.device("cpu")
    )
    sampler.capture(8)
    assert sampler.captured_sizes == []
    hidden = torch.randn(5, 32)
    assert torch.equal(sampler(hidden), centroid_argmax_reference(hidden, lm_head, mask))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_graphs_give_the_eager_tokens() -> None:
    lm_head, mask = _head("cuda")
    sampler = GraphedGreedySampler(
        lambda h: centroid_argmax_fused(mask, h, lm_head), 32, torch.float32, torch.device("cuda")
    )
    for size in (16, 8, 4):  # largest first, as vLLM captures
        sampler.capture(size)
    assert sampler.captured_sizes == [4, 8, 16]
    for rows in (1, 3, 4, 5, 16, 17):  # 17: beyond the largest capture -> eager
        hidden = torch.randn(rows, 32, device="cuda")
        first = sampler(hidden)
        expected = centroid_argmax_reference(hidden, lm_head, mask)
        assert torch.equal(first, expected)
        sampler(torch.randn(rows, 32, device="cuda"))  # the next replay must not alter `first`
        assert torch.equal(first, expected)


def test_e2b_shaped_pair_is_a_valid_pair_of_the_published_size() -> None:
    target, assistant = e2b_shaped.target_config(), e2b_shaped.assistant_config()
    validate_pair(target, assistant)
    with torch.device("meta"):
        from transformers import Gemma4ForCausalLM

        params = sum(p.numel() for p in Gemma4ForCausalLM(target).parameters())
    assert 4.5e9 < params < 4.7e9  # E2B with its per-layer embeddings: ~4.6 B


def test_missing_k_norms_are_added_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = build_tiny_e2b_like_target(tmp_path / "t", multimodal=False)
    added = add_missing_k_norms(target)
    # transformers saves no k_norm for the 2 KV-shared layers (4, 5) of this target.
    assert added == [f"model.layers.{i}.self_attn.k_norm.weight" for i in (4, 5)]
    assert add_missing_k_norms(target) == []
