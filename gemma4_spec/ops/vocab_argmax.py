"""Greedy argmax over the whole vocabulary, for assistants without a centroid head.

The Gemma 4 26B-A4B and 31B assistants have no centroids: their greedy draft token is the
argmax of the full logits ``hidden [T, H] @ lm_head [V, H]^T``. ``vocab_argmax_reference`` is
the definition the kernel (``vocab_argmax_triton.py``) is held to:

* dot products summed in float32 from the given (e.g. bfloat16) values;
* the ``suppressed`` tokens (the assistant's generation config) are never chosen, exactly as
  ``Gemma4AssistantForDrafting.compute_logits`` sets their logits to ``-inf``; a row whose every
  token is suppressed gets id 0, what ``argmax`` of an all ``-inf`` row returns;
* ties go to the smallest token id: PyTorch's ``argmax`` returns the first maximal index.

No soft-capping: ``tanh(x / cap) * cap`` is increasing, so the largest logit stays the largest
and the argmax is the same. (In floating point the cap can round two close logits to one value,
e.g. both saturating at ``cap``; then ``argmax`` of the capped logits takes the smaller id of the
two, where this takes the truly larger logit.) NaN logits are not defined here.
"""

from __future__ import annotations

import torch


def vocab_argmax_reference(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, suppressed: torch.Tensor | None = None
) -> torch.Tensor:
    """Greedy token ids ``[T]`` int64 by definition: float32 logits ``[T, V]``, suppressed
    tokens at ``-inf``, ``argmax``. Plain torch, materialises everything."""
    logits = hidden.float() @ lm_head_weight.float().t()
    if suppressed is not None and suppressed.numel() > 0:
        logits[:, suppressed.to(logits.device)] = float("-inf")
    return logits.argmax(dim=-1)
