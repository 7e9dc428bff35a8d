"""Run gemma4_mtp on vLLM's V1 model runner, where our proposer lives.

Wraps: the property ``vllm.config.vllm.VllmConfig.use_v2_model_runner``. From vLLM 0.26 on, a
GPU engine runs Gemma 4 on Model Runner V2, which drafts with its own speculator and never
instantiates a V1 proposer: the plugin would silently not be used. When the engine drafts with
gemma4_mtp (``SpeculativeConfig.use_gemma4_mtp()``) and ``VLLM_USE_V2_MODEL_RUNNER`` is unset,
the property answers False, and the first time it does in a process we log it. An explicit
``VLLM_USE_V2_MODEL_RUNNER=1`` is rejected before any engine starts (``checks.check_model_runner``).
vLLM versions: 0.26 - 0.33 (the property reads the same environment variable in all of them).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.log import get_logger
from gemma4_spec.patch.hooks import is_ours, ours

CONFIG_MODULE = "vllm.config.vllm"
GEMMA4_MTP = "gemma4_mtp"

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
        if not drafts_with_gemma4_mtp(self) or explicit_runner_choice() is not None:
            return decide(self)
        _log_once()
        return False

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


def explicit_runner_choice() -> bool | None:
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM parses it: None when unset."""
    import vllm.envs as envs

    return envs.VLLM_USE_V2_MODEL_RUNNER


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "gemma4_spec: speculative method gemma4_mtp selects vLLM's V1 model runner "
            "(the gemma4-spec proposer runs there; Model Runner V2 would use its own)."
        )
