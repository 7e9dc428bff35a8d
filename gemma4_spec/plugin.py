"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process it starts. It is cheap and idempotent: it registers
our model class by name (imported lazily by vLLM) and defers each patch until vLLM imports the
module it patches. With ``VLLM_PLUGINS`` excluding ``gemma4_spec`` nothing here runs and vLLM's
in-tree gemma4_mtp is used, so the two can be compared side by side.
"""

from __future__ import annotations

from gemma4_spec.compat import SUPPORTED_VLLM, installed_vllm_version, vllm_is_supported
from gemma4_spec.log import get_logger
from gemma4_spec.patch import (
    patch_allocate_slots,
    patch_cpu_expand,
    patch_cpu_generators,
    patch_engine_args,
    patch_gpu_model_runner,
    patch_input_processor,
    patch_rejection_sampler,
    patch_request_params,
    patch_top_k_only,
    patch_triton_attn,
    patch_v2_rejection_sampler,
    patch_v2_sample,
    patch_v2_speculator,
    patch_v2_warmup,
    patch_vllm_config,
)
from gemma4_spec.patch.hooks import when_imported

logger = get_logger(__name__)

# vLLM's architecture name for gemma4_assistant checkpoints (set by its SpeculativeConfig).
ASSISTANT_ARCHITECTURE = "Gemma4MTPModel"
MODEL_CLASS = "gemma4_spec.models.gemma4_mtp:Gemma4AssistantForDrafting"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    # Always installed: on an unsupported vLLM it is what tells a gemma4_mtp user so.
    when_imported(patch_engine_args.ARG_UTILS_MODULE, patch_engine_args.apply)
    if not vllm_is_supported():
        logger.warning(
            "gemma4-spec supports vLLM %s, found %s: leaving vLLM's in-tree gemma4_mtp in place.",
            SUPPORTED_VLLM,
            installed_vllm_version(),
        )
        return

    from vllm import ModelRegistry

    ModelRegistry.register_model(ASSISTANT_ARCHITECTURE, MODEL_CLASS)
    when_imported(patch_gpu_model_runner.RUNNER_MODULE, patch_gpu_model_runner.apply)
    when_imported(patch_vllm_config.CONFIG_MODULE, patch_vllm_config.apply)
    when_imported(patch_triton_attn.TRITON_ATTN_MODULE, patch_triton_attn.apply)
    when_imported(patch_rejection_sampler.REJECTION_SAMPLER_MODULE, patch_rejection_sampler.apply)
    when_imported(patch_cpu_expand.REJECTION_SAMPLER_MODULE, patch_cpu_expand.apply)
    when_imported(patch_top_k_only.TOPK_TOPP_MODULE, patch_top_k_only.apply)
    when_imported(patch_cpu_generators.RUNNER_MODULE, patch_cpu_generators.apply)
    when_imported(patch_v2_warmup.WORKER_MODULE, patch_v2_warmup.apply)
    when_imported(patch_input_processor.INPUT_PROCESSOR_MODULE, patch_input_processor.apply)
    when_imported(patch_input_processor.INPUT_PROCESSOR_MODULE, patch_request_params.apply)
    when_imported(patch_v2_speculator.SPECULATOR_MODULE, patch_v2_speculator.apply)
    when_imported(
        patch_v2_rejection_sampler.V2_REJECTION_SAMPLER_MODULE, patch_v2_rejection_sampler.apply
    )
    when_imported(patch_v2_sample.V2_RUNNER_MODULE, patch_v2_sample.apply)
    when_imported(patch_allocate_slots.SCHEDULER_MODULE, patch_allocate_slots.apply)
