"""Verify all-greedy batches on Model Runner V2 with one argmax and one small kernel.

For every batch, greedy or not, V2's ``RejectionSampler.__call__`` gathers the drafts and
positions, applies the sampling parameters, and runs its general rejection sampling: per-block
logits statistics over the whole vocabulary, the acceptance kernel, a resampling kernel (for a
greedy request, the argmax again) and a kernel that inserts its tokens, with seven buffers
allocated on the way. For an all-greedy batch where nothing changes the logits
(``greedy_verify_applies``), the result is each row's argmax compared with the drafts: one
argmax over all rows and one launch (``ops/greedy_verify.greedy_verify_rows``) give the same
tokens and counts; vLLM's own ``get_num_sampled_and_rejected`` then corrects them for prompt
chunks, as vLLM's path does. With synthetic acceptance (vLLM's benchmark mode for random
weights) V2 runs the same kernels and draws acceptance instead of comparing: ours draws it the
same way, so a synthetic-acceptance benchmark times the verification that real greedy traffic
gets, for ours as for vLLM's own.

Wraps: ``vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler.__init__`` (a
sampler built for a gemma4_mtp engine carries a ``GreedyVerifyStats``, unless
``GEMMA4_SPEC_GREEDY_VERIFY=0``, and compiles the kernel then, since vLLM's warm-up samples
and never takes this path) and ``__call__`` (samplers carrying one take the new path for
the batches the gate lets through; everything else runs vLLM's method as it is); adds
``gemma4_spec_verify_greedy_tokens`` (the same path from each row's greedy token, for
``patch_v2_sample.py``). vLLM versions:
``compat.V2_GREEDY_VERIFY_VLLM`` (0.26, whose sampler states the gate reads).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np
import torch

from gemma4_spec.compat import v2_greedy_verify_supported
from gemma4_spec.ops.centroid_argmax_triton import triton_usable
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_rejection_sampler import (
    GREEDY_VERIFY_ATTR,
    GREEDY_VERIFY_ENV,
    GreedyVerifyStats,
)
from gemma4_spec.switches import turned_off

V2_REJECTION_SAMPLER_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
# The method the wrapped class gains: (best [rows] int64, input_batch) -> SamplerOutput.
VERIFY_GREEDY_TOKENS = "gemma4_spec_verify_greedy_tokens"


def greedy_verify_applies(rejection_sampler: Any, input_batch: Any, draft_logits: Any) -> bool:
    """Whether V2's rejection sampling would keep exactly the drafts that equal the argmax of
    the logits it is given (or, with synthetic acceptance, the drafts its draws accept), and add
    the argmax after them: greedy requests (temperature 0), drafts without distributions, no
    block verification, nothing that changes the logits or asks for logprobs, and for
    synthetic acceptance logits where our kernel runs (it draws as V2's does). min_p, top_k and
    top_p only mask tokens below the best one: they never change an argmax."""
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    rs = rejection_sampler
    if draft_logits is not None or rs.use_block_verification:
        return False
    rates = rs.synthetic_conditional_rates
    if rates is not None and not triton_usable(rates.device):
        return False
    sampler = rs.sampler
    idx = input_batch.idx_mapping_np
    states = sampler.sampling_states
    return bool(
        np.all(states.temperature.np[idx] == 0.0)
        and states.max_num_logprobs(idx) == NO_LOGPROBS
        and not np.any(sampler.logit_bias_state.use_logit_bias[idx])
        and not np.any(sampler.penalties_state.use_penalty[idx])
        and int(sampler.bad_words_state.num_bad_words.np[idx].max()) == 0
    )


def apply(module: ModuleType) -> None:
    sampler_class = getattr(module, "RejectionSampler", None)
    if sampler_class is None or is_ours(sampler_class.__call__):
        return
    if not v2_greedy_verify_supported():
        return
    from gemma4_spec.ops.greedy_verify import compile_greedy_verify_rows

    vllms_init = sampler_class.__init__
    vllms_call = sampler_class.__call__

    @functools.wraps(vllms_init)
    def __init__(
        self: Any, sampler: Any, spec_config: Any, device: Any, *args: Any, **kwargs: Any
    ) -> None:
        vllms_init(self, sampler, spec_config, device, *args, **kwargs)
        check = getattr(spec_config, "use_gemma4_mtp", None)
        if callable(check) and check() and not turned_off(GREEDY_VERIFY_ENV):
            setattr(self, GREEDY_VERIFY_ATTR, GreedyVerifyStats())
            compile_greedy_verify_rows(
                torch.device(device),
                self.num_speculative_steps + 1,
                self.synthetic_conditional_rates,
            )

    @functools.wraps(vllms_call)
    def __call__(self: Any, logits: Any, input_batch: Any, draft_logits: Any = None) -> Any:
        if getattr(self, GREEDY_VERIFY_ATTR, None) is None or not greedy_verify_applies(
            self, input_batch, draft_logits
        ):
            return vllms_call(self, logits, input_batch, draft_logits)
        num_nans = module.get_num_nans(logits) if self.sampler.compute_nans else None
        return verified_output(module, self, logits.argmax(dim=-1), input_batch, num_nans)

    def verify_greedy_tokens(self: Any, best: Any, input_batch: Any) -> Any:
        return verified_output(module, self, best, input_batch, None)

    sampler_class.__init__ = ours(__init__)
    sampler_class.__call__ = ours(__call__)
    # For patch_v2_sample.py, which has each row's greedy token without the logits.
    setattr(sampler_class, VERIFY_GREEDY_TOKENS, verify_greedy_tokens)


def verified_output(
    module: ModuleType, rejection_sampler: Any, best: Any, input_batch: Any, num_nans: Any
) -> Any:
    """V2's ``SamplerOutput`` (``module``'s names) for a batch ``greedy_verify_applies`` lets
    through, from each logits row's greedy token ``best`` (``[rows]`` int64), as V2's rejection
    sampling gives it."""
    tokens = verify_rows(
        module,
        rejection_sampler,
        best,
        input_batch.input_ids,
        input_batch.positions,
        input_batch.seq_lens,
        input_batch.logits_indices,
        input_batch.cu_num_logits,
        input_batch.idx_mapping,
        *request_arrays(rejection_sampler),
    )
    return sampler_output(module, rejection_sampler, *tokens, num_nans)


def request_arrays(rejection_sampler: Any) -> tuple[Any, ...]:
    """The per-request arrays ``verify_rows`` reads besides the step's, as vLLM holds them
    now: the prefill lengths, and the seeds where acceptance is synthetic. V2 keeps both in
    ``UvaBackedTensor`` rings whose ``.gpu`` moves to another buffer at every update, so they
    are looked up at each use (a CUDA graph must copy them in, not bake in a pointer)."""
    sampler = rejection_sampler.sampler
    arrays = (sampler.req_states.prefill_len.gpu,)
    if rejection_sampler.synthetic_conditional_rates is not None:
        arrays += (sampler.sampling_states.seeds.gpu,)
    return arrays


def verify_rows(
    module: ModuleType,
    rejection_sampler: Any,
    best: Any,
    input_ids: Any,
    positions: Any,
    seq_lens: Any,
    logits_indices: Any,
    cu_num_logits: Any,
    idx_mapping: Any,
    prefill_len: Any,
    seeds: Any = None,
) -> tuple[Any, Any, Any]:
    """(sampled tokens ``[R, k + 1]``, sampled counts, rejected counts) of a greedy batch from
    each logits row's greedy token ``best``: our verification kernel (with the sampler's
    synthetic acceptance, if it has one, drawn from ``seeds``), then V2's count correction for
    prompt chunks (``prefill_len``). Every tensor is passed in (``request_arrays`` gives the
    last two): ``spec_decode/verify_graphs.py`` launches this over its own copies."""
    from gemma4_spec.ops.greedy_verify import SyntheticAcceptance, greedy_verify_rows

    rs = rejection_sampler
    synthetic = None
    if rs.synthetic_conditional_rates is not None:
        if seeds is None:
            raise ValueError("synthetic acceptance draws from the requests' seeds: pass them")
        synthetic = SyntheticAcceptance(
            rs.synthetic_conditional_rates, seeds, idx_mapping, positions
        )
    sampled, num_sampled = greedy_verify_rows(
        best, input_ids, logits_indices, cu_num_logits, rs.num_speculative_steps + 1, synthetic
    )
    num_sampled, num_rejected = module.get_num_sampled_and_rejected(
        num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len
    )
    return sampled, num_sampled, num_rejected


def sampler_output(
    module: ModuleType,
    rejection_sampler: Any,
    sampled: Any,
    num_sampled: Any,
    num_rejected: Any,
    num_nans: Any,
) -> Any:
    """V2's ``SamplerOutput`` of a batch our greedy path verified, counted in the sampler's
    ``GreedyVerifyStats``."""
    getattr(rejection_sampler, GREEDY_VERIFY_ATTR).batches += 1
    return module.SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_tensors=None,
        num_nans=num_nans,
        num_sampled=num_sampled,
        num_rejected=num_rejected,
    )
