"""Int32 counters on a device for kernels whose last-arriving program finishes the work (the
split-K sums of ``small_linear``, the segment sums of ``split_attention``): made zeroed once
per device and kernel, outside any CUDA-graph capture, and left at zero by every launch that
uses them, so a later launch or graph replay starts clean."""

from __future__ import annotations

import torch

from gemma4_spec.ops.centroid_argmax_triton import _capturing

_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}


def device_counters(owner: str, device: torch.device | str, capacity: int) -> torch.Tensor:
    """``owner``'s ``capacity`` counters on ``device``, made on the first call. A CUDA device
    named without an index (vLLM's device config says "cuda") is the current one, as a
    tensor's device would name it: one set of counters whichever way the caller names it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (owner, str(device))
    counters = _COUNTERS.get(key)
    if counters is None:
        if _capturing(device):
            raise RuntimeError(
                f"{owner}: first launch on {device} inside graph capture; make its counters "
                "(one launch, or its prepare function) before capturing"
            )
        counters = torch.zeros(capacity, dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def counters_of(owner: str) -> list[torch.Tensor]:
    """Every device's counters of ``owner`` made so far (tests check they are back at zero)."""
    return [counters for (name, _), counters in _COUNTERS.items() if name == owner]
