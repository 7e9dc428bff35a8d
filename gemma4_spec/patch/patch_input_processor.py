"""Load the logits-processor plugins when the front end starts, not in the first request.

Wraps: ``vllm.v1.engine.input_processor.InputProcessor.__init__``, the front end's request
checker, built once per engine. vLLM checks each request's sampling parameters against every
installed logits-processor plugin; it finds them by scanning the entry points of every installed
distribution (``importlib.metadata``) the first time a request is checked, and keeps the result
(``cached_load_custom_logitsprocs``, keyed by the model's ``logits_processors``). That scan lands
in the user's first request: on the GPU machine it took about a third of a one-request first
pass (``benchmarks/results/h200``). After the processor is built, the wrapper fills the same
cache with the same key, so the scan runs at start-up and the first request finds it done; a
plugin that fails to load then fails the start, as it would have failed the first request.

Only for engines drafting with gemma4_mtp (others keep vLLM's timing), and only where vLLM
checks lazily: on 0.26 on either runner, on 0.32 and 0.33 on Model Runner V1. There, Model
Runner V2 loads its own classes in the processor's constructor (``_build_logits_processors_
params_validator``), so there is nothing left to move. ``GEMMA4_SPEC_EARLY_LOGITSPROCS=0``
turns it off.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp
from gemma4_spec.switches import turned_off

INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
LOGITSPROCS_MODULE = "vllm.v1.sample.logits_processor"
CACHED_LOADER = "cached_load_custom_logitsprocs"
EAGER_V2_CHECKER = "_build_logits_processors_params_validator"  # vLLM 0.32+
EARLY_LOGITSPROCS_ENV = "GEMMA4_SPEC_EARLY_LOGITSPROCS"


def apply(module: ModuleType) -> None:
    processor = getattr(module, "InputProcessor", None)
    if processor is None or is_ours(processor.__init__):
        return
    original = processor.__init__

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        if checks_lazily(type(self), vllm_config):
            load_logitsprocs_now(vllm_config.model_config)

    processor.__init__ = ours(__init__)


def checks_lazily(processor: type, vllm_config: Any) -> bool:
    """Whether this engine's front end would scan for logits-processor plugins in its first
    request (and the move is ours to make: a gemma4_mtp engine, the switch on)."""
    if turned_off(EARLY_LOGITSPROCS_ENV) or not drafts_with_gemma4_mtp(vllm_config):
        return False
    eager_v2 = hasattr(processor, EAGER_V2_CHECKER)
    return not (eager_v2 and getattr(vllm_config, "use_v2_model_runner", False))


def logitsprocs_cache() -> Any:
    """vLLM's cache of the logits-processor classes its request check loads (an ``lru_cache``
    over its loader), or None in a vLLM without it."""
    import importlib

    return getattr(importlib.import_module(LOGITSPROCS_MODULE), CACHED_LOADER, None)


def load_logitsprocs_now(model_config: Any) -> None:
    """Fill vLLM's cache of logits-processor classes under the key its request check uses."""
    loader = logitsprocs_cache()
    if loader is None:
        return  # a vLLM without the cache: nothing to fill (the contract test names it)
    configured = getattr(model_config, "logits_processors", None)
    loader(tuple(configured) if configured is not None else None)
