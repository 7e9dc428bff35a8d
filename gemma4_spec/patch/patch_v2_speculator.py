"""Model Runner V2 drafts gemma4_mtp through our draft loop.

Replaces: ``vllm.v1.worker.gpu.spec_decode.gemma4.speculator.Gemma4Speculator``, the name vLLM's
``init_speculator`` imports (when it is called) for a gemma4_mtp engine, with its subclass
``spec_decode/runner_v2.Gemma4LoopSpeculator``: every draft step a one-query step over each
request's last accepted token, the whole loop one CUDA graph per batch size, captured at
start-up, and keys that end at the last accepted token. ``GEMMA4_SPEC_V2_DRAFT_LOOP=0`` keeps
vLLM's speculator (which then drafts with our model all the same). vLLM versions:
``compat.V2_DRAFT_LOOP_VLLM`` (0.26); on others vLLM's speculator stays.
"""

from __future__ import annotations

from types import ModuleType

from gemma4_spec.compat import v2_draft_loop_supported
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.switches import turned_off

SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.gemma4.speculator"
V2_DRAFT_LOOP_ENV = "GEMMA4_SPEC_V2_DRAFT_LOOP"


def apply(module: ModuleType) -> None:
    original = getattr(module, "Gemma4Speculator", None)
    if original is None or is_ours(original):
        return
    if turned_off(V2_DRAFT_LOOP_ENV) or not v2_draft_loop_supported():
        return
    from gemma4_spec.spec_decode.runner_v2 import Gemma4LoopSpeculator

    module.Gemma4Speculator = ours(Gemma4LoopSpeculator)
