"""Gemma 4 ``config.json`` in the form every supported transformers reads.

transformers >= 5.19 saves a Gemma 4 text config's full-attention head size (and, for
``attention_k_eq_v`` models, its KV-head count) as ``per_layer_config`` overrides. Older releases
(5.14, what vLLM 0.26 works with) read ``per_layer_config`` too, but then refuse the global
``head_dim`` that their Gemma 4 code reads (``AmbiguousGlobalPerLayerAttributeError``); and
where all layers share one head size, 5.19 writes an empty ``per_layer_config`` and no
``global_head_dim``, which 5.14 would read as its default of 512.

The real Google checkpoints carry the flat fields instead: ``global_head_dim`` and
``num_global_key_value_heads``. Both releases read those (5.19 turns them into its per-layer
overrides on load), so every checkpoint this project writes is rewritten to that form after
``save_pretrained``.

The vision tower's rotary embedding is the same story: 5.19 writes ``rope_type: "axial"``, which
5.14 does not know; both read the ``"default"`` older checkpoints carry (5.19 maps it to axial).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["portable_text_config", "portable_vision_config", "write_portable_config"]

_TEXT_MODEL_TYPE = "gemma4_text"
_VISION_MODEL_TYPE = "gemma4_vision"
_FULL_ATTENTION = "full_attention"
# What the flat form can say about a full-attention layer.
_FLAT_OVERRIDES = frozenset({"head_dim", "num_key_value_heads"})


def portable_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``gemma4_text`` config dict with ``per_layer_config`` turned into the flat
    ``global_head_dim`` / ``num_global_key_value_heads`` fields.

    Raises ``ValueError`` where the overrides are more than the flat form can hold (another
    attribute, a sliding layer, full layers that differ among themselves)."""
    if text.get("model_type") != _TEXT_MODEL_TYPE:
        raise ValueError(f"not a {_TEXT_MODEL_TYPE} config: model_type={text.get('model_type')!r}")
    out = dict(text)
    # Keys are layer indices, serialised as (possibly zero-padded) strings.
    overrides = {int(k): v for k, v in (out.pop("per_layer_config", None) or {}).items()}
    if "per_layer_config" not in text and "global_head_dim" in text:
        return out  # already flat
    layer_types: list[str] = out["layer_types"]
    full_layers = [i for i, kind in enumerate(layer_types) if kind == _FULL_ATTENTION]

    for layer, values in overrides.items():
        if layer not in full_layers or set(values) - _FLAT_OVERRIDES:
            kind = layer_types[layer] if 0 <= layer < len(layer_types) else "no such layer"
            raise ValueError(
                f"per_layer_config of layer {layer} ({kind}: {sorted(values)}) "
                "cannot be written as global_head_dim / num_global_key_value_heads"
            )
    per_full_layer = [overrides.get(layer, {}) for layer in full_layers]
    if any(values != per_full_layer[0] for values in per_full_layer):
        raise ValueError(f"full-attention layers differ among themselves: {overrides}")
    shared = per_full_layer[0] if per_full_layer else {}

    # Written even when equal to head_dim: older releases default global_head_dim to 512.
    out["global_head_dim"] = shared.get("head_dim", out["head_dim"])
    if "num_key_value_heads" in shared:
        if not out.get("attention_k_eq_v", False):
            # Older releases apply num_global_key_value_heads to attention_k_eq_v models only.
            raise ValueError("a full-attention KV-head override needs attention_k_eq_v")
        out["num_global_key_value_heads"] = shared["num_key_value_heads"]
    return out


def portable_vision_config(vision: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``gemma4_vision`` config dict with an ``axial`` rotary type written as
    ``default``."""
    if vision.get("model_type") != _VISION_MODEL_TYPE:
        raise ValueError(
            f"not a {_VISION_MODEL_TYPE} config: model_type={vision.get('model_type')!r}"
        )
    out = dict(vision)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type") == "axial":
        out["rope_parameters"] = {**rope, "rope_type": "default"}
    return out


def write_portable_config(checkpoint_dir: str | Path) -> Path:
    """Rewrite ``checkpoint_dir/config.json`` in place (a ``gemma4_text`` config, or a
    ``gemma4`` / ``gemma4_assistant`` one with a ``text_config`` and maybe a ``vision_config``),
    in transformers' own layout
    (two-space indent, sorted keys). Other configs are left as they are. Returns the file."""
    path = Path(checkpoint_dir) / "config.json"
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if config.get("model_type") == _TEXT_MODEL_TYPE:
        config = portable_text_config(config)
    elif isinstance(config.get("text_config"), dict) and (
        config["text_config"].get("model_type") == _TEXT_MODEL_TYPE
    ):
        config["text_config"] = portable_text_config(config["text_config"])
        vision = config.get("vision_config")
        if isinstance(vision, dict) and vision.get("model_type") == _VISION_MODEL_TYPE:
            config["vision_config"] = portable_vision_config(vision)
    else:
        return path
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
