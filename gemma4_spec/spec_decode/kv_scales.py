"""Give each assistant attention layer the KV-cache quantization scales of the target layer whose
cache it reads.

With a quantized KV cache (e.g. fp8) the target's layers carry per-layer K/V scales, loaded from
the checkpoint or calibrated. The assistant's layers never write a cache of their own and load
no scales, so left alone they would dequantize the target's cache with scale 1.0: still lossless
(the target verifies every draft) but with worse drafts. vLLM keeps each scale in up to three
forms (a device tensor, a Python float, a host tensor); all are copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

_TENSOR_SCALES = ("_k_scale", "_v_scale", "_k_scale_cpu", "_v_scale_cpu")
_FLOAT_SCALES = ("_k_scale_float", "_v_scale_float")


def share_kv_scales(draft_layer_names: Iterable[str], layers: Mapping[str, nn.Module]) -> int:
    """Copy scales from each draft layer's ``kv_sharing_target_layer_name`` layer; returns how
    many draft layers got them."""
    shared = 0
    for name in draft_layer_names:
        draft = layers[name]
        source_name = getattr(draft, "kv_sharing_target_layer_name", None)
        if source_name is None:
            continue
        source = layers[source_name]
        with torch.no_grad():
            for attr in _TENSOR_SCALES:
                theirs, ours = getattr(source, attr, None), getattr(draft, attr, None)
                if isinstance(theirs, torch.Tensor) and isinstance(ours, torch.Tensor):
                    ours.copy_(theirs)
        for attr in _FLOAT_SCALES:
            if hasattr(source, attr):
                setattr(draft, attr, getattr(source, attr))
        shared += 1
    return shared
