"""share_kv_scales: each draft layer takes the K/V scales of the target layer it reads."""

from __future__ import annotations

import torch
from torch import nn

from gemma4_spec.spec_decode.kv_scales import share_kv_scales


def _layer(k: float, v: float, source: str | None = None) -> nn.Module:
    layer = nn.Module()
    layer.kv_sharing_target_layer_name = source
    for name, value in (("_k_scale", k), ("_v_scale", v)):
        layer.register_buffer(name, torch.tensor(value))
        setattr(layer, f"{name}_float", value)
        setattr(layer, f"{name}_cpu", torch.tensor(value))
    return layer


def test_draft_layers_get_their_source_layers_scales() -> None:
    layers = {
        "model.layers.2.attn": _layer(0.5, 0.25),  # sliding target layer
        "model.layers.3.attn": _layer(2.0, 4.0),  # full target layer
        "assistant.layers.0.attn": _layer(1.0, 1.0, "model.layers.2.attn"),
        "assistant.layers.1.attn": _layer(1.0, 1.0, "model.layers.3.attn"),
    }
    draft = ["assistant.layers.0.attn", "assistant.layers.1.attn"]
    before = layers["assistant.layers.0.attn"]._k_scale

    assert share_kv_scales(draft, layers) == 2

    for name, source in zip(draft, ("model.layers.2.attn", "model.layers.3.attn"), strict=True):
        ours, theirs = layers[name], layers[source]
        for attr in ("_k_scale", "_v_scale", "_k_scale_cpu", "_v_scale_cpu"):
            assert torch.equal(getattr(ours, attr), getattr(theirs, attr)), (name, attr)
        assert (ours._k_scale_float, ours._v_scale_float) == (
            theirs._k_scale_float,
            theirs._v_scale_float,
        )
    # Copied in place: compiled graphs holding the buffer see the new value.
    assert layers["assistant.layers.0.attn"]._k_scale is before
    # The target's own scales are untouched.
    assert layers["model.layers.3.attn"]._k_scale.item() == 2.0


def test_a_layer_without_a_source_is_skipped_one_without_scale_tensors_gets_the_floats() -> None:
    # "own" reads no target layer: left as it is, not counted. "bare" reads one but has no
    # scale tensors to copy into: it still takes the float scales, and counts.
    plain = nn.Module()
    plain.kv_sharing_target_layer_name = "t"
    layers = {"t": _layer(3.0, 3.0), "own": _layer(1.0, 1.0), "bare": plain}
    assert share_kv_scales(["own", "bare"], layers) == 1
    assert layers["own"]._k_scale.item() == 1.0
    assert plain._k_scale_float == 3.0 and not hasattr(plain, "_k_scale")
