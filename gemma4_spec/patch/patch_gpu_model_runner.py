"""Make vLLM's V1 GPU model runner (and the CPU runner, its subclass) draft with our proposer.

Replaces: ``vllm.v1.worker.gpu_model_runner.Gemma4Proposer``, the name the runner instantiates
for the gemma4_mtp method and checks with ``isinstance`` (per-group block tables, metadata).
Rebinding that one module global swaps the class everywhere the runner uses it.

Wraps: ``GPUModelRunner._calc_spec_decode_metadata``. When the runner's drafter is ours and has
a ``verify_metadata`` builder (``spec_decode/verify_metadata.py``: the same arrays in one
transfer), the builder answers; otherwise vLLM's method runs as it is.
vLLM versions: 0.26 - 0.33 (the name, the method's signature and ``SpecDecodeMetadata`` are the
same in all of them).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def apply(runner_module: ModuleType) -> None:
    from gemma4_spec.spec_decode.proposer import Gemma4Proposer

    if not hasattr(runner_module, "Gemma4Proposer"):
        raise RuntimeError(
            f"{RUNNER_MODULE} has no Gemma4Proposer: this vLLM is not one gemma4-spec supports."
        )
    runner_module.Gemma4Proposer = Gemma4Proposer

    runner = runner_module.GPUModelRunner
    vllms = runner._calc_spec_decode_metadata
    if getattr(vllms, "gemma4_spec", False):
        return  # already wrapped

    @functools.wraps(vllms)
    def _calc_spec_decode_metadata(
        self: Any, num_draft_tokens: Any, cu_num_scheduled_tokens: Any
    ) -> Any:
        builder = getattr(getattr(self, "drafter", None), "verify_metadata", None)
        if builder is None:
            return vllms(self, num_draft_tokens, cu_num_scheduled_tokens)
        return builder.build(num_draft_tokens, cu_num_scheduled_tokens, self.input_ids.gpu)

    _calc_spec_decode_metadata.gemma4_spec = True  # type: ignore[attr-defined]
    runner._calc_spec_decode_metadata = _calc_spec_decode_metadata
