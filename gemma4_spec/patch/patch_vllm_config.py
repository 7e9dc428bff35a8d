"""Run gemma4_mtp on vLLM's V1 model runner, where our proposer lives.

Wraps: the property ``vllm.config.vllm.VllmConfig.use_v2_model_runner``. From vLLM 0.26 on, a
GPU engine runs Gemma 4 on Model Runner V2, which drafts with its own speculator and never
instantiates a V1 proposer: the plugin would silently not be used. When the engine drafts with
gemma4_mtp (``SpeculativeConfig.use_gemma4_mtp()``) and ``VLLM_USE_V2_MODEL_RUNNER`` is unset,
the property answers False, and the first time it does in a process we log it. An explicit
``VLLM_USE_V2_MODEL_RUNNER=1`` is rejected before any engine starts (``checks.check_model_runner``).
vLLM versions: 0.26 - 0.33 (the property reads the same environment variable in all of them).

Experimental, opt-in (``GEMMA4_SPEC_EXPERIMENTAL_V2=1``): vLLM's own runner choice stands, so on
GPU gemma4_mtp runs on Model Runner V2 with vLLM's ``Gemma4Speculator`` drafting through this
plugin's assistant model (its ``get_top_tokens``, the centroid argmax, when the speculative
config sets ``use_local_argmax_reduction``). On the H200 (d947542, ``benchmarks/e2e_decode.py
--v2-experiment``) it ran at the in-tree version's cost, above the V1 path's, so V1 stays the
default.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.log import get_logger
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.switches import turned_on

CONFIG_MODULE = "vllm.config.vllm"
GEMMA4_MTP = "gemma4_mtp"
EXPERIMENTAL_V2_ENV = "GEMMA4_SPEC_EXPERIMENTAL_V2"

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
        if experimental_v2():
            _log_once(
                "gemma4_spec: experimental: vLLM picks the model runner for gemma4_mtp (Model "
                "Runner V2 on GPU: vLLM's speculator drafts with this plugin's assistant model)."
            )
            return decide(self)
        _log_once(
            "gemma4_spec: speculative method gemma4_mtp selects vLLM's V1 model runner "
            "(the gemma4-spec proposer runs there; Model Runner V2 would use its own)."
        )
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


def experimental_v2() -> bool:
    """Whether the experimental Model Runner V2 path is asked for (see the module docstring)."""
    return turned_on(EXPERIMENTAL_V2_ENV)


def explicit_runner_choice() -> bool | None:
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM parses it: None when unset."""
    import vllm.envs as envs

    return envs.VLLM_USE_V2_MODEL_RUNNER


def _log_once(message: str) -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(message)
