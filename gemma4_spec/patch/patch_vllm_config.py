"""Pick the model runner gemma4_mtp runs on.

Wraps: the property ``vllm.config.vllm.VllmConfig.use_v2_model_runner``. Both of vLLM's GPU
runners are supported: the V1 runner, where this plugin's ``Gemma4Proposer`` drafts, and Model
Runner V2, where our subclass of vLLM's ``Gemma4Speculator`` (``spec_decode/runner_v2.py``; vLLM's
own on versions it is not installed on) drafts with this plugin's assistant model and its
``get_top_tokens`` (the centroid argmax; ``patch_engine_args`` turns on
``use_local_argmax_reduction`` for greedy drafting). ``VLLM_USE_V2_MODEL_RUNNER`` decides when
set, as everywhere in vLLM. When it is unset and the engine drafts with gemma4_mtp
(``SpeculativeConfig.use_gemma4_mtp()``), the runner is ``DEFAULT_RUNNER``, the one
``benchmarks/real_work.py`` measured faster on real work (the README has the figures); the
first time that choice overrides vLLM's in a process we log it. Today that is V2, vLLM's own
choice, so the wrapper changes nothing unless ``DEFAULT_RUNNER`` says "V1". The CPU runner is
V1 whatever this says. vLLM versions: 0.26 - 0.33 (the property reads the same environment
variable in all of them).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.log import get_logger
from gemma4_spec.patch.hooks import is_ours, ours

CONFIG_MODULE = "vllm.config.vllm"
GEMMA4_MTP = "gemma4_mtp"
# "V1" or "V2": gemma4_mtp's runner when VLLM_USE_V2_MODEL_RUNNER is unset.
DEFAULT_RUNNER = "V2"

logger = get_logger(__name__)
_logged = False


def apply(config_module: ModuleType) -> None:
    config_cls = config_module.VllmConfig
    original = config_cls.__dict__.get("use_v2_model_runner")
    if not isinstance(original, property) or original.fget is None:
        raise RuntimeError(
            f"{CONFIG_MODULE}.VllmConfig has no use_v2_model_runner property: this vLLM is not "
            "one gemma4-spec supports."
        )
    if is_ours(original.fget):
        return
    decide = original.fget

    @functools.wraps(decide)
    def use_v2_model_runner(self: Any) -> bool:
        vllms = decide(self)
        if (
            not drafts_with_gemma4_mtp(self)
            or explicit_runner_choice() is not None
            or needs_v2(self)
        ):
            return vllms
        chosen = vllms and DEFAULT_RUNNER == "V2"
        if chosen != vllms:
            _log_once(
                f"gemma4_spec: speculative method gemma4_mtp runs on vLLM's {DEFAULT_RUNNER} "
                "model runner (set VLLM_USE_V2_MODEL_RUNNER to choose)."
            )
        return chosen

    config_cls.use_v2_model_runner = property(ours(use_v2_model_runner))


def drafts_with_gemma4_mtp(vllm_config: Any) -> bool:
    """vLLM rewrites the method of a gemma4_mtp request to "mtp" (draft model_type
    "gemma4_mtp"); ``SpeculativeConfig.use_gemma4_mtp()`` says which it is."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    check = getattr(spec, "use_gemma4_mtp", None)
    if callable(check):
        return bool(check())
    return getattr(spec, "method", None) == GEMMA4_MTP


def needs_v2(vllm_config: Any) -> bool:
    """Features that run on Model Runner V2 only (vLLM 0.32+: HiSparse attention, watermarking):
    vLLM's choice stands, or they would be dropped silently."""
    attention = getattr(vllm_config, "attention_config", None)
    return (
        getattr(attention, "hisparse_config", None) is not None
        or getattr(vllm_config, "watermark_config", None) is not None
    )


def explicit_runner_choice() -> bool | None:
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM parses it: None when unset."""
    import vllm.envs as envs

    return envs.VLLM_USE_V2_MODEL_RUNNER


def _log_once(message: str) -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(message)
