"""The greedy token of each row of soft-capped logits, from the logits before the cap.

Gemma 4 caps its final logits: vLLM's ``LogitsProcessor`` computes ``logits / cap``, ``tanh``
and ``* cap`` as three elementwise passes over ``[rows, V]`` values (V = 262144), each rounded to
the logits' dtype, and a greedy verification then reads them a fourth time for the argmax.
``capped_argmax(raw, cap)`` returns the argmax of those capped logits while reading the raw
ones once (``capped_argmax_triton.py``): each value is capped in registers by the same
float32 operations and roundings, and the largest capped value wins, ties going to the smallest
id, as ``torch.argmax`` does. The cap is not skipped: it is increasing, but its roundings make
close logits equal (both saturate at ``cap`` in bfloat16, for one), and then the smaller id is
the greedy token, where the raw logits would pick the larger logit.

A logit of ``-inf`` stays ``-inf``: it is a token the target suppresses (vLLM's multimodal Gemma
4 sets the checkpoint's ``suppress_tokens`` to ``-inf`` after the cap, and the verification
here applies them to the logits before the cap), never a value of the lm_head, so it must lose
to every capped logit, as it does in vLLM's order, not tie at ``-cap`` with the saturated ones.

``capped_argmax_reference`` is the definition: vLLM's three operations in torch, ``-inf`` kept,
then ``argmax``. The kernel holds to it only if its ``tanh`` rounds as torch's does on this device,
so ``cap_is_exact`` checks that once per (device, dtype): every bfloat16 and float16 value, and
a spread of float32 ones, capped both ways, bit for bit. Where the check fails, or Triton cannot
run, ``capped_argmax`` runs the reference. Not defined here: NaN logits, and rows whose largest
logit is not zero but of magnitude below ``SMALLEST_CHECKED`` (where float32 arithmetic may flush
subnormals to zero, as GPU kernels may and torch does not; no language model's row is such).
"""

from __future__ import annotations

import torch

from gemma4_spec.ops.centroid_argmax_triton import triton_usable

# Nonzero values of smaller magnitude are left out of the exactness check (module docstring).
SMALLEST_CHECKED = 2.0**-100
# float32 values the exactness check caps besides the special ones: the check's seed and count.
CHECK_FLOAT32_SEED = 0
CHECK_FLOAT32_COUNT = 1 << 20

_EXACT: dict[tuple[str, torch.dtype, float], bool] = {}


def soft_cap_reference(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The capped logits as vLLM's ``LogitsProcessor`` computes them (a new tensor)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def capped_values_reference(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``soft_cap_reference`` of every value but ``-inf`` (a suppressed token), which stays
    ``-inf``: the values ``capped_argmax`` takes the argmax of (module docstring)."""
    if cap is None:
        return logits
    return torch.where(logits == float("-inf"), logits, soft_cap_reference(logits, cap))


def capped_argmax_reference(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``[rows]`` int64: ``argmax`` of ``capped_values_reference(logits, cap)`` (plain torch)."""
    return capped_values_reference(logits, cap).argmax(dim=-1)


def check_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The values ``cap_is_exact`` caps: every bit pattern of a 16-bit dtype (but NaNs and
    nonzero values below ``SMALLEST_CHECKED``), and for float32 the specials, the integers from
    -64 to 64 and ``CHECK_FLOAT32_COUNT`` values of every magnitude from 1e-8 to 1e4 of both
    signs."""
    if dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
        values = bits.view(dtype)
        size = values.float().abs()
        keep = ~torch.isnan(values) & ((size == 0) | (size >= SMALLEST_CHECKED))
        return values[keep].to(device)
    gen = torch.Generator().manual_seed(CHECK_FLOAT32_SEED)
    magnitude = torch.pow(10.0, torch.rand(CHECK_FLOAT32_COUNT, generator=gen) * 12 - 8)
    sign = torch.where(torch.rand(CHECK_FLOAT32_COUNT, generator=gen) < 0.5, -1.0, 1.0)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])
    whole = torch.arange(-64, 65, dtype=torch.float32)
    return torch.cat([specials, whole, magnitude * sign]).to(dtype=dtype, device=device)


def cap_is_exact(dtype: torch.dtype, device: torch.device, cap: float) -> bool:
    """Whether the kernel caps every value of ``check_values`` bit for bit as torch does
    (computed once per device, dtype and cap)."""
    from gemma4_spec.ops.capped_argmax_triton import soft_cap_values

    key = (str(device), dtype, float(cap))
    if key not in _EXACT:
        values = check_values(dtype, device)
        ours = soft_cap_values(values, cap)
        torchs = capped_values_reference(values, cap)
        _EXACT[key] = bool(torch.equal(ours.view(-1), torchs.view(-1)))
    return _EXACT[key]


def kernel_applies(logits: torch.Tensor, cap: float | None) -> bool:
    """Whether ``capped_argmax`` runs the kernel for these logits (else the reference)."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        return False
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if not triton_usable(logits.device):
        return False
    return cap is None or cap_is_exact(logits.dtype, logits.device, cap)


def capped_argmax(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``[rows]`` int64: the tokens of ``capped_argmax_reference(logits, cap)``, from one read
    of ``logits [rows, V]`` where the kernel applies (module docstring)."""
    if not kernel_applies(logits, cap):
        return capped_argmax_reference(logits, cap)
    from gemma4_spec.ops.capped_argmax_triton import capped_argmax_kernel

    return capped_argmax_kernel(logits, cap)
