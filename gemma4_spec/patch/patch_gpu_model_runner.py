"""Make vLLM's V1 GPU model runner (and the CPU runner, its subclass) draft with our proposer.

Replaces: ``vllm.v1.worker.gpu_model_runner.Gemma4Proposer``, the name the runner instantiates
for the gemma4_mtp method and checks with ``isinstance`` (per-group block tables, metadata).
Rebinding that one module global swaps the class everywhere the runner uses it.
vLLM versions: 0.26 - 0.33 (the name and its uses are the same in all of them).
"""

from __future__ import annotations

from types import ModuleType

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def apply(runner_module: ModuleType) -> None:
    from gemma4_spec.spec_decode.proposer import Gemma4Proposer

    if not hasattr(runner_module, "Gemma4Proposer"):
        raise RuntimeError(
            f"{RUNNER_MODULE} has no Gemma4Proposer: this vLLM is not one gemma4-spec supports."
        )
    runner_module.Gemma4Proposer = Gemma4Proposer
