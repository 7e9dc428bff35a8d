"""The checks a gemma4_mtp request gets before any engine starts (called from the patch of
``EngineArgs.create_speculative_config``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemma4_spec.compat import UnsupportedVLLMVersionError, check_vllm_version
from gemma4_spec.validation import (
    AssistantMismatchError,
    UnsupportedConfigurationError,
    read_token_ordering,
    validate_pair,
    validate_tensor_parallel,
    validate_token_ordering,
)

__all__ = [
    "UnsupportedConfigurationError",
    "check_gemma4_mtp_request",
    "explain_failed_gemma4_mtp_request",
]

_NEEDS_ASSISTANT = (
    "method 'gemma4_mtp' needs an assistant checkpoint: pass "
    '--speculative-config \'{"method": "gemma4_mtp", "model": ASSISTANT, '
    '"num_speculative_tokens": K}\'.'
)


def check_gemma4_mtp_request(spec_config: Any) -> None:
    """Raise a clear error if this vLLM, the target or the assistant cannot run gemma4_mtp."""
    check_vllm_version()
    _check_parallelism(spec_config)
    _check_environment()
    draft = spec_config.draft_model_config
    target = spec_config.target_model_config
    if draft is None or target is None:
        raise AssistantMismatchError(_NEEDS_ASSISTANT)
    assistant_config = draft.hf_config
    validate_pair(target.hf_config, assistant_config)
    parallel = getattr(spec_config, "target_parallel_config", None)
    validate_tensor_parallel(assistant_config, _tensor_parallel_size(parallel))
    if getattr(assistant_config, "use_ordered_embeddings", False):
        checkpoint = _local_checkpoint_dir(draft.model, getattr(draft, "revision", None))
        ordering = read_token_ordering(checkpoint)
        if ordering is None:
            raise AssistantMismatchError(
                f"The assistant at {draft.model} uses centroid masking "
                "(use_ordered_embeddings: true) but its checkpoint has no "
                "masked_embedding.token_ordering tensor. Use the complete assistant checkpoint."
            )
        validate_token_ordering(
            ordering,
            assistant_config.get_text_config().vocab_size,
            assistant_config.num_centroids,
        )


def _check_parallelism(spec_config: Any) -> None:
    stages = getattr(
        getattr(spec_config, "target_parallel_config", None), "pipeline_parallel_size", 1
    )
    if stages > 1:
        raise UnsupportedConfigurationError(
            f"gemma4_mtp drafting does not support pipeline parallelism "
            f"(pipeline_parallel_size={stages}): the assistant needs the target's input "
            "embedding and its K/V caches on the last stage. Use tensor parallelism instead "
            "(--tensor-parallel-size) with pipeline_parallel_size=1."
        )


def _check_environment() -> None:
    """Settings read later, at engine start-up, checked now."""
    from gemma4_spec.patch.patch_split_attention import (
        own_draft_mode,
        own_split_mode,
        split_sizes,
    )
    from gemma4_spec.patch.patch_triton_attn import large_verify_tokens, verify_segments_setting

    verify_segments_setting()
    large_verify_tokens()
    own_split_mode()
    own_draft_mode()
    split_sizes()


def _tensor_parallel_size(target_parallel_config: Any) -> int:
    """The target's tensor-parallel size (of its ``ParallelConfig``, None: one rank), which the
    draft runs with (vLLM gives the draft the target's ranks)."""
    return getattr(target_parallel_config, "tensor_parallel_size", 1)


def explain_failed_gemma4_mtp_request(spec: Mapping[str, Any] | None, error: Exception) -> None:
    """vLLM's ``SpeculativeConfig`` rejected a gemma4_mtp request: say why, if our checks can.

    Raises our error (chained to vLLM's) when the version, the missing draft or the pair checks
    explain the failure; returns, so the caller re-raises vLLM's error, when they do not. The
    draft config is read with transformers, as vLLM never got to build it.
    """
    try:
        check_vllm_version()
    except UnsupportedVLLMVersionError as ours:
        raise ours from error
    spec = spec or {}
    model = spec.get("model")
    if model is None:
        raise AssistantMismatchError(_NEEDS_ASSISTANT) from error
    target = spec.get("target_model_config")
    if target is None:
        return
    try:
        from transformers import AutoConfig

        assistant_config = AutoConfig.from_pretrained(str(model), revision=spec.get("revision"))
        validate_pair(target.hf_config, assistant_config)
        # vLLM's own head-count check of the draft names neither the model nor a fix.
        tp_size = _tensor_parallel_size(spec.get("target_parallel_config"))
        validate_tensor_parallel(assistant_config, tp_size)
    except (AssistantMismatchError, UnsupportedConfigurationError) as ours:
        raise ours from error
    except Exception:  # our diagnosis failed too: vLLM's own error is the better report
        return


def _local_checkpoint_dir(model: str, revision: str | None) -> Path:
    """The folder holding the assistant's safetensors (a local path, or the hub cache)."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    # vLLM downloads the same files to the same cache to load the weights.
    return Path(
        snapshot_download(
            model, revision=revision, allow_patterns=["*.safetensors", "*.safetensors.index.json"]
        )
    )
