"""The E4B-, 26B-A4B- and 31B-shaped pairs of ``gemma4_spec.testing.families`` have each
family's structure: tiny checkpoints as written (configs, tensors, what transformers loads), and
the published shapes as configs only. No engine runs here (``test_engine_families.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Gemma4AssistantForCausalLM

from gemma4_spec.testing.families import (
    FAMILIES,
    build_family_pair,
    real_shape_configs,
)
from gemma4_spec.testing.tiny import FULL, SLIDING
from gemma4_spec.validation import kv_source_layers, layer_attention_shape, validate_pair

PATTERN_12 = [SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL]

# family: (KV-shared layers, sliding and full layers' (KV heads, head size), k_eq_v, MoE experts,
# centroids, backbone width, assistant query heads, target layers the assistant reads)
TINY: dict[str, tuple[Any, ...]] = {
    "e4b": (6, (2, 32), (2, 64), False, None, True, 128, 4, [4, 5]),
    "26b-a4b": (0, (4, 32), (1, 64), True, 4, False, 192, 8, [10, 11]),
    "31b": (0, (4, 32), (1, 64), True, None, False, 256, 8, [10, 11]),
}
# The published figures, and the target layers the 4-layer assistant [s, s, s, f] reads.
REAL: dict[str, tuple[Any, ...]] = {
    "e4b": (42, 18, (2, 256), (2, 512), None, True, 2560, 256, 4, [22, 22, 22, 23]),
    "26b-a4b": (30, 0, (8, 256), (2, 512), (128, 8, 704), False, 2816, 1024, 16, [28] * 3 + [29]),
    "31b": (60, 0, (16, 256), (4, 512), None, False, 5376, 1024, 32, [58, 58, 58, 59]),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_pair(family, root / family) for family in FAMILIES}


def _tensors(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_pair_has_the_family_structure(
    pairs: dict[str, tuple[Path, Path]], family: str
) -> None:
    shared, sliding, full, k_eq_v, experts, centroids, backbone, heads, sources = TINY[family]
    target_dir, assistant_dir = pairs[family]
    target = AutoConfig.from_pretrained(target_dir)
    assistant = AutoConfig.from_pretrained(assistant_dir)
    validate_pair(target, assistant)
    text, draft = target.get_text_config(), assistant.get_text_config()

    assert target.model_type == "gemma4_text" and text.layer_types == PATTERN_12
    assert text.num_kv_shared_layers == shared and bool(text.attention_k_eq_v) == k_eq_v
    assert layer_attention_shape(text, 0) == sliding and layer_attention_shape(text, 5) == full
    assert [layer_attention_shape(draft, i) for i in range(2)] == [sliding, full]
    assert assistant.backbone_hidden_size == text.hidden_size == backbone != draft.hidden_size
    assert draft.num_attention_heads == heads
    assert assistant.use_ordered_embeddings == centroids
    assert kv_source_layers(text, draft) == sources
    assert (text.num_experts, text.enable_moe_block) == (experts, experts is not None)
    assert (text.hidden_size_per_layer_input > 0) == (family == "e4b")

    tensors = _tensors(target_dir)
    own_kv = range(12 - shared)
    for layer in range(12):
        prefix = f"model.layers.{layer}."
        # KV-shared layers have no K/V projections; full layers of k_eq_v targets have K only.
        assert (prefix + "self_attn.k_proj.weight" in tensors) == (layer in own_kv)
        has_v = layer in own_kv and not (k_eq_v and text.layer_types[layer] == FULL)
        assert (prefix + "self_attn.v_proj.weight" in tensors) == has_v
        if experts is not None:
            assert tensors[prefix + "experts.gate_up_proj"] == (experts, 2 * 64, backbone)
            assert prefix + "mlp.gate_proj.weight" in tensors  # the dense MLP beside them
        else:
            assert not any(name.startswith(prefix + "router.") for name in tensors)
    has_centroids = "masked_embedding.centroids.weight" in _tensors(assistant_dir)
    assert has_centroids == centroids

    # The flat config form (global_head_dim, num_global_key_value_heads) in both files.
    for folder in (target_dir, assistant_dir):
        raw = json.loads((folder / "config.json").read_text())
        raw = raw.get("text_config", raw)
        assert "per_layer_config" not in raw and raw["global_head_dim"] == 64
        assert raw.get("num_global_key_value_heads") == (full[0] if k_eq_v else None)

    for cls, folder in (
        (AutoModelForCausalLM, target_dir),
        (Gemma4AssistantForCausalLM, assistant_dir),
    ):
        _, info = cls.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], folder


def test_tiny_pair_is_deterministic(pairs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    for seed, equal in ((0, True), (1, False)):
        again = build_family_pair("26b-a4b", tmp_path / str(seed), seed=seed)
        for old, new in zip(pairs["26b-a4b"], again, strict=True):
            same = (old / "model.safetensors").read_bytes() == (
                new / "model.safetensors"
            ).read_bytes()
            assert same == equal


@pytest.mark.parametrize("family", FAMILIES)
def test_real_shape_configs_are_the_published_shapes(family: str) -> None:
    layers, shared, sliding, full, moe, centroids, backbone, width, heads, sources = REAL[family]
    target, assistant = real_shape_configs(family)
    validate_pair(target, assistant)
    draft = assistant.get_text_config()
    assert target.num_hidden_layers == layers and target.num_kv_shared_layers == shared
    assert target.layer_types == ([SLIDING] * 5 + [FULL]) * (layers // 6)
    assert layer_attention_shape(target, 0) == sliding
    assert layer_attention_shape(target, 5) == full
    assert target.vocab_size == draft.vocab_size == 262_144
    assert (target.num_experts, target.top_k_experts, target.moe_intermediate_size) == (
        moe or (None, None, None)
    )
    assert target.hidden_size == assistant.backbone_hidden_size == backbone
    assert (draft.hidden_size, draft.num_attention_heads, draft.num_hidden_layers) == (
        width,
        heads,
        4,
    )
    assert assistant.use_ordered_embeddings == centroids
    if centroids:
        assert (assistant.num_centroids, assistant.centroid_intermediate_top_k) == (2048, 32)
    assert kv_source_layers(target, draft) == sources


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown Gemma 4 family 'e2b'"):
        build_family_pair("e2b", tmp_path)
    with pytest.raises(ValueError, match="unknown Gemma 4 family"):
        real_shape_configs("26b")


def test_config_only_target_for_engine_drawn_weights(tmp_path: Path) -> None:
    # The 26B-A4B and 31B benchmark targets: config.json only (vLLM's load_format="dummy" draws
    # the weights), the assistant a real checkpoint (the plugin reads it before loading).
    from gemma4_spec.testing.e2b_shaped import assistant_config, build_random_pair, target_config

    target, assistant = build_random_pair(
        tmp_path, target_config(), assistant_config(), device="cpu", target_weights=False
    )
    assert not list(target.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(target)
    assert config.architectures == ["Gemma4ForCausalLM"]
    assert config.num_hidden_layers == target_config().num_hidden_layers
    assert list(assistant.glob("*.safetensors"))
