"""Verify all-greedy batches with one argmax and one small kernel (``ops/greedy_verify.py``)
instead of vLLM's rejection sampler.

For a greedy batch vLLM's ``RejectionSampler.forward`` gathers the bonus and the draft-scoring
logits rows apart, runs the bonus rows through its sampler, casts and copies the scoring rows,
takes their argmax and launches its greedy kernel: about 0.35 ms of host a step on the H200
machine (``benchmarks/e2e_decode.py --scopes``), besides copies of full-vocabulary rows. When
nothing can change the logits (``greedy_verify_applies``), the result is each row's argmax,
compared with the drafts: one argmax over all rows and one launch give the same tokens.

Wraps: ``vllm.v1.sample.rejection_sampler.RejectionSampler.forward``. Only samplers carrying a
``GreedyVerifyStats`` as ``GREEDY_VERIFY_ATTR`` take the new path (our proposer gives its
runner's sampler one when it loads, unless ``GEMMA4_SPEC_GREEDY_VERIFY=0``), only on the vLLM
versions in ``compat.GREEDY_VERIFY_VLLM``, and only for batches the gate lets through;
everything else runs vLLM's method as it is. vLLM versions: 0.26 - 0.33 (the method's
signature and ``SamplerOutput`` are the same in all of them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gemma4_spec.compat import greedy_verify_supported, logits_processor_idle
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.switches import turned_off

REJECTION_SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"
GREEDY_VERIFY_ENV = "GEMMA4_SPEC_GREEDY_VERIFY"
GREEDY_VERIFY_ATTR = "gemma4_spec_greedy_verify"


@dataclass
class GreedyVerifyStats:
    """Carried by a rejection sampler that may verify greedy batches itself."""

    batches: int = 0  # batches it verified itself
    # Of them, on Model Runner V2: batches whose logits were computed without the soft-cap
    # (patch/patch_v2_sample.py).
    uncapped: int = 0
    # Of them, on Model Runner V2: batches verified by replaying a start-up CUDA graph
    # (spec_decode/verify_graphs.py).
    graphed: int = 0


def greedy_verify_enabled() -> bool:
    return not turned_off(GREEDY_VERIFY_ENV) and greedy_verify_supported()


def greedy_verify_applies(sampler: Any, draft_probs: Any, sampling_metadata: Any) -> bool:
    """Whether vLLM's rejection sampler would keep exactly the drafts that equal the argmax of
    the raw logits, and add the argmax after them: greedy drafts and requests, and nothing that
    changes logits or asks for logprobs."""
    m = sampling_metadata
    if draft_probs is not None or not m.all_greedy or getattr(sampler, "synthetic_mode", False):
        return False
    # vLLM 0.33's FLy verification (rejection_sample_method "fly") also keeps drafts that
    # differ from the argmax: not what a plain argmax comparison gives.
    if getattr(sampler, "use_fly", False):
        return False
    if m.max_num_logprobs is not None or getattr(m, "logprob_token_ids", None):
        return False
    if not m.no_penalties or m.allowed_token_ids_mask is not None or m.bad_words_token_ids:
        return False
    holder = getattr(m, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    return all(logits_processor_idle(p) for p in m.logitsprocs.non_argmax_invariant)


def apply(module: ModuleType) -> None:
    from vllm.v1.outputs import SamplerOutput

    from gemma4_spec.ops.greedy_verify import greedy_verify

    sampler_class = module.RejectionSampler
    vllms = sampler_class.forward
    if is_ours(vllms):
        return  # already wrapped

    @functools.wraps(vllms)
    def forward(
        self: Any, metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any
    ) -> Any:
        stats = getattr(self, GREEDY_VERIFY_ATTR, None)
        if stats is not None and greedy_verify_applies(self, draft_probs, sampling_metadata):
            stats.batches += 1
            tokens = greedy_verify(
                logits.argmax(dim=-1),
                metadata.draft_token_ids,
                metadata.cu_num_draft_tokens,
                metadata.max_spec_len,
            )
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        return vllms(self, metadata, draft_probs, logits, sampling_metadata)

    sampler_class.forward = ours(forward)
