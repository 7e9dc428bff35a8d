"""Check a gemma4_mtp request before vLLM starts any engine process.

Wraps: ``vllm.engine.arg_utils.EngineArgs.create_speculative_config``, which builds the draft's
config in the front-end process. When the request is for Gemma 4 MTP, the wrapper checks the
vLLM version and the target/assistant pair (sizes, KV shapes, vocab, centroids,
``token_ordering``) and raises one clear error instead of a failure deep inside a worker. If
vLLM's own ``SpeculativeConfig`` rejects a gemma4_mtp request first (e.g. the draft is not an
assistant), the same checks explain why, chained to vLLM's error. A checked request drafts
greedily through our centroid argmax on Model Runner V2 too (``draft_with_our_argmax``), and
with ``GEMMA4_SPEC_TARGET_LINEAR=1`` the compilation config gets the target's compile ranges
(``ops/target_linear_ranges.py``).
vLLM versions: any (the version check itself must run on unsupported versions).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.patch.hooks import is_ours, ours

ARG_UTILS_MODULE = "vllm.engine.arg_utils"


def apply(arg_utils: ModuleType) -> None:
    engine_args = arg_utils.EngineArgs
    original = engine_args.create_speculative_config
    if is_ours(original):
        return

    @functools.wraps(original)
    def create_speculative_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        requested = _requests_gemma4_mtp(self)
        try:
            spec_config = original(self, *args, **kwargs)
        except Exception as exc:
            # vLLM rejects some bad gemma4_mtp requests itself, with errors that do not say what
            # is wrong (a draft that is not an assistant: "Unsupported speculative method: 'mtp'").
            # Explain with our checks when they find the cause; otherwise vLLM's error stands.
            if requested:
                from gemma4_spec.checks import explain_failed_gemma4_mtp_request

                explain_failed_gemma4_mtp_request(self.speculative_config, exc)
            raise
        if spec_config is None:
            return None
        draft = spec_config.draft_model_config
        draft_type = getattr(getattr(draft, "hf_config", None), "model_type", None)
        from gemma4_spec.validation import ASSISTANT_MODEL_TYPES

        if requested or draft_type in ASSISTANT_MODEL_TYPES:
            from gemma4_spec.checks import check_gemma4_mtp_request

            check_gemma4_mtp_request(spec_config)
            draft_with_our_argmax(spec_config)
            _split_target_ranges(self)
        return spec_config

    engine_args.create_speculative_config = ours(create_speculative_config)


def _split_target_ranges(engine_args: Any) -> None:
    """With the target's matmuls asked onto our kernel (opt-in), its compiled graphs past
    ``TARGET_MAX_ROWS`` tokens keep ``mm``: set on the compilation config here, before vLLM
    builds the engine's config and models from it (``ops/target_linear_ranges.py``). The
    opt-in is checked before that module is imported: it imports vLLM's compile-pass
    internals, which a request without the opt-in should not depend on."""
    from gemma4_spec.ops.small_linear import target_rows_wanted

    if target_rows_wanted():
        from gemma4_spec.ops.target_linear_ranges import prepare_target_ranges

        prepare_target_ranges(engine_args)


def _requests_gemma4_mtp(engine_args: Any) -> bool:
    spec = engine_args.speculative_config
    method = spec.get("method") if isinstance(spec, dict) else None
    return "gemma4_mtp" in (method, getattr(engine_args, "spec_method", None))


def draft_with_our_argmax(spec_config: Any) -> None:
    """Greedy drafting on Model Runner V2 through the assistant's ``get_top_tokens`` (our
    centroid argmax) instead of full-vocabulary logits: vLLM's ``use_local_argmax_reduction``,
    which excludes probabilistic drafting. The V1 proposer uses ``get_top_tokens`` anyway."""
    if getattr(spec_config, "draft_sample_method", "greedy") == "probabilistic":
        return
    if hasattr(spec_config, "use_local_argmax_reduction"):
        spec_config.use_local_argmax_reduction = True
