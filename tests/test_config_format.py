"""Checkpoint configs in the flat form every supported transformers reads (config_format).

These run on the installed transformers; ``tests/test_old_transformers.py`` loads the same
checkpoints with the oldest supported one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, Gemma4TextConfig

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.testing.config_format import (
    portable_text_config,
    portable_vision_config,
    write_portable_config,
)
from gemma4_spec.testing.tiny import (
    GLOBAL_HEAD_DIM,
    HEAD_DIM,
    build_tiny_e2b_like_target,
    build_tiny_pair,
)
from gemma4_spec.validation import layer_attention_shape

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _text(**fields: Any) -> dict[str, Any]:
    """A gemma4_text config dict as the installed transformers saves it."""
    config = Gemma4TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=len(LAYERS),
        layer_types=list(LAYERS),
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        **fields,
    )
    return json.loads(config.to_json_string())


def _shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    loaded = Gemma4TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    return [layer_attention_shape(loaded, i) for i in range(len(LAYERS))]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"global_head_dim": 32}, {"global_head_dim": 32}),
        # Equal sizes: written anyway, older releases would read their default of 512.
        ({"global_head_dim": 16}, {"global_head_dim": 16}),
        (
            {"global_head_dim": 32, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
            {"global_head_dim": 32, "num_global_key_value_heads": 1},
        ),
    ],
)
def test_flat_form_means_what_per_layer_config_meant(
    fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    saved = _text(**fields)
    flat = portable_text_config(saved)
    assert "per_layer_config" not in flat
    assert {key: flat.get(key) for key in expected} == expected
    assert _shapes(flat) == _shapes(saved)
    assert portable_text_config(flat) == flat  # already flat: unchanged


@pytest.mark.parametrize(
    ("per_layer", "match"),
    [
        ({"0": {"head_dim": 32}}, "layer 0 \\(sliding_attention"),
        ({"1": {"intermediate_size": 8}}, "layer 1 \\(full_attention"),
        ({"7": {"head_dim": 32}}, "layer 7 \\(no such layer"),
        ({"1": {"head_dim": 32}, "3": {"head_dim": 64}}, "differ among themselves"),
        ({"1": {"head_dim": 32}}, "differ among themselves"),  # layer 3 keeps head_dim
        ({"1": {"num_key_value_heads": 1}, "3": {"num_key_value_heads": 1}}, "attention_k_eq_v"),
    ],
)
def test_overrides_the_flat_form_cannot_hold_are_refused(
    per_layer: dict[str, Any], match: str
) -> None:
    config = {**_text(global_head_dim=16), "per_layer_config": per_layer}
    with pytest.raises(ValueError, match=match):
        portable_text_config(config)


def test_not_a_text_config_is_refused() -> None:
    with pytest.raises(ValueError, match="gemma4_text"):
        portable_text_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="gemma4_vision"):
        portable_vision_config({"model_type": "gemma4_text"})


def test_tiny_builders_write_the_flat_form(tmp_path: Path) -> None:
    target, assistant = build_tiny_pair(tmp_path / "pair")
    multimodal = build_tiny_e2b_like_target(tmp_path / "e2b_like")
    for folder in (target, assistant, multimodal):
        text = (folder / "config.json").read_text()
        assert "per_layer_config" not in text and '"global_head_dim": 64' in text
        loaded = AutoConfig.from_pretrained(folder).get_text_config()
        shapes = [layer_attention_shape(loaded, i)[1] for i in range(loaded.num_hidden_layers)]
        full = [kind == "full_attention" for kind in loaded.layer_types]
        assert shapes == [GLOBAL_HEAD_DIM if f else HEAD_DIM for f in full]
    vision = json.loads((multimodal / "config.json").read_text())["vision_config"]
    assert vision["rope_parameters"]["rope_type"] == "default"
    # ... which the installed transformers reads back as the axial rotary its vision tower has.
    assert AutoConfig.from_pretrained(multimodal).vision_config.rope_parameters["rope_type"] == (
        "axial"
    )


def test_shipped_pair_is_in_the_flat_form(tmp_path: Path) -> None:
    for folder in tiny_gsm8k_pair():
        original = (folder / "config.json").read_bytes()
        assert b"per_layer_config" not in original and b'"global_head_dim"' in original
        copy = tmp_path / folder.name
        copy.mkdir()
        (copy / "config.json").write_bytes(original)
        write_portable_config(copy)
        assert (copy / "config.json").read_bytes() == original  # what the builder writes


def test_other_configs_are_left_alone(tmp_path: Path) -> None:
    text = '{"model_type": "llama"}'
    (tmp_path / "config.json").write_text(text)
    write_portable_config(tmp_path)
    assert (tmp_path / "config.json").read_text() == text
