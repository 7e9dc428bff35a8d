"""Let vLLM's top-k-only filter take a batch of no rows.

A verification step can reach vLLM's rejection sampler with no draft tokens at all (every
scheduled request drafted nothing this step); the rejection sampler still applies the sampled
requests' constraints to its (empty) draft-scoring logits. On CPU, a top-k without top-p goes
to ``apply_top_k_only``, whose ``k.max()`` raises on an empty ``k`` (``max(): Expected
reduction dim to be specified for input.numel() == 0``): one ``top_k`` request kills the
engine.

Wraps: ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only`` (looked up by name in that
module by ``apply_top_k_top_p_pytorch``): with no rows there is nothing to filter and the logits
are returned as they are; otherwise vLLM's function runs. vLLM versions:
``compat.CPU_SAMPLING_VLLM`` (0.32, where the crash was shown); elsewhere it is left alone.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from gemma4_spec.compat import cpu_sampling_fixes_needed
from gemma4_spec.patch.hooks import is_ours, ours

TOPK_TOPP_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"


def apply(module: ModuleType) -> None:
    vllms = getattr(module, "apply_top_k_only", None)
    if vllms is None or is_ours(vllms) or not cpu_sampling_fixes_needed():
        return

    @functools.wraps(vllms)
    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return vllms(logits, k)

    module.apply_top_k_only = ours(apply_top_k_only)
