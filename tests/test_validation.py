"""Unit tests for gemma4_spec.validation: config-only checks, no vLLM engine, no weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    Gemma4AssistantConfig,
    Gemma4Config,
    Gemma4TextConfig,
    LlamaConfig,
    PretrainedConfig,
)

from gemma4_spec.validation import (
    TOKEN_ORDERING_KEY,
    AssistantMismatchError,
    UnsupportedConfigurationError,
    kv_source_layers,
    layer_attention_shape,
    read_token_ordering,
    supported_tensor_parallel_sizes,
    validate_pair,
    validate_tensor_parallel,
    validate_token_ordering,
)

S, F = "sliding_attention", "full_attention"
VOCAB = 2048
NUM_CENTROIDS = 64


def target_text(**overrides: Any) -> Gemma4TextConfig:
    """A tiny known-good target: 3 sliding layers (2 KV heads x 32) + 1 full layer (2 x 64)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        sliding_window=16,
        layer_types=[S, S, S, F],
    )
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


def assistant(text_overrides: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """A tiny assistant matching ``target_text()``: layers [sliding, full], all KV-shared."""
    text_kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        sliding_window=16,
        layer_types=[S, F],
        num_kv_shared_layers=2,
    )
    text_kwargs.update(text_overrides or {})
    kwargs: dict[str, Any] = dict(
        backbone_hidden_size=128,
        use_ordered_embeddings=True,
        num_centroids=NUM_CENTROIDS,
        centroid_intermediate_top_k=8,
    )
    kwargs.update(overrides)
    return Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text_kwargs), **kwargs)


def as_vllm_sees_it(config: Any) -> Any:
    """Mimic vLLM's SpeculativeConfig rewrite of a gemma4_assistant draft config."""
    rewritten = copy.deepcopy(config)
    rewritten.model_type = "gemma4_mtp"
    rewritten.text_config.num_kv_shared_layers = 0
    rewritten.architectures = ["Gemma4MTPModel"]
    return rewritten


def mismatch(target: Any, draft: Any) -> str:
    with pytest.raises(AssistantMismatchError) as info:
        validate_pair(target, draft)
    return str(info.value)


# --- good pairs ----------------------------------------------------------------------------


def test_good_pair_passes() -> None:
    validate_pair(target_text(), assistant())


def test_good_pair_passes_after_vllm_rewrite() -> None:
    validate_pair(target_text(), as_vllm_sees_it(assistant()))


def test_multimodal_target_passes() -> None:
    validate_pair(Gemma4Config(text_config=target_text()), as_vllm_sees_it(assistant()))


def test_error_is_a_value_error() -> None:
    assert issubclass(AssistantMismatchError, ValueError)


# --- bad pairs -----------------------------------------------------------------------------


def test_backbone_hidden_size_mismatch() -> None:
    message = mismatch(target_text(), assistant(backbone_hidden_size=1536))
    assert "backbone_hidden_size=1536" in message
    assert "hidden_size=128" in message
    assert "google/gemma-4-E2B-it-assistant" in message


def test_vocab_mismatch() -> None:
    message = mismatch(target_text(vocab_size=4096), assistant())
    assert "vocab_size=2048" in message and "vocab_size=4096" in message


def test_vocab_not_divisible_by_num_centroids() -> None:
    message = mismatch(target_text(), assistant(num_centroids=100, centroid_intermediate_top_k=8))
    assert "num_centroids=100" in message and "vocab_size=2048" in message


def test_centroid_top_k_out_of_range() -> None:
    message = mismatch(target_text(), assistant(centroid_intermediate_top_k=65))
    assert "centroid_intermediate_top_k=65" in message and "num_centroids=64" in message


def test_centroid_checks_skipped_without_ordered_embeddings() -> None:
    validate_pair(target_text(), assistant(use_ordered_embeddings=False, num_centroids=100))


def test_kv_heads_mismatch() -> None:
    message = mismatch(target_text(), assistant({"num_key_value_heads": 1}))
    assert "num_key_value_heads=1 vs 2" in message
    assert "layer 0" in message and "layer 2" in message


def test_full_attention_head_dim_mismatch() -> None:
    message = mismatch(target_text(), assistant({"global_head_dim": 32}))
    assert "head_dim=32 vs 64" in message
    assert "layer 1" in message and "layer 3" in message and "full_attention" in message


# 26B-A4B / 31B style: full layers share K and V and have fewer KV heads (2 of 4 here).
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)


def test_k_eq_v_pair_passes() -> None:
    draft = as_vllm_sees_it(assistant(K_EQ_V, use_ordered_embeddings=False))
    validate_pair(target_text(**K_EQ_V), draft)


def test_k_eq_v_fields_missing_from_the_assistant() -> None:
    message = mismatch(target_text(**K_EQ_V), assistant())
    assert "layer 1 ('full_attention')" in message and "num_key_value_heads=2 vs 1" in message
    assert "attention_k_eq_v: true and num_global_key_value_heads: 1" in message


def test_k_eq_v_hint_only_for_that_cause() -> None:
    # A sliding layer's mismatch, and a full layer's where the target has no k_eq_v (the
    # assistant claims it), get the plain message.
    for target, draft, where in (
        (target_text(**K_EQ_V), assistant({**K_EQ_V, "num_key_value_heads": 1}), "layer 0"),
        (target_text(), assistant(K_EQ_V), "layer 1"),
    ):
        message = mismatch(target, draft)
        assert where in message and "attention_k_eq_v" not in message


def test_backbone_mismatch_names_the_published_target() -> None:
    message = mismatch(target_text(), assistant(backbone_hidden_size=2816))
    assert "google/gemma-4-26B-A4B-it" in message


def test_sliding_window_mismatch() -> None:
    message = mismatch(target_text(), assistant({"sliding_window": 32}))
    assert "sliding_window=32 vs 16" in message


def test_attention_heads_not_a_multiple_of_kv_heads() -> None:
    message = mismatch(target_text(), assistant({"num_attention_heads": 3}))
    assert "num_attention_heads=3" in message and "num_key_value_heads=2" in message


def test_target_without_layer_type_the_assistant_needs() -> None:
    # 6 layers, last 2 KV-shared: the 4 layers with their own K/V are all sliding.
    target = target_text(
        num_hidden_layers=6, layer_types=[S, S, S, S, S, F], num_kv_shared_layers=2
    )
    message = mismatch(target, assistant())
    assert "'full_attention'" in message and "num_kv_shared_layers=2" in message


def test_non_gemma4_target() -> None:
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=128, architectures=["LlamaForCausalLM"])
    message = mismatch(llama, assistant())
    assert "not a Gemma 4 model" in message
    assert "'llama'" in message and "LlamaForCausalLM" in message


def test_assistant_passed_as_target() -> None:
    message = mismatch(assistant(), assistant())
    assert "'gemma4_assistant'" in message


def test_non_assistant_draft() -> None:
    message = mismatch(target_text(), target_text())
    assert "not a Gemma 4 assistant" in message and "'gemma4_text'" in message


def test_checkpoint_name_appears_in_message() -> None:
    draft = assistant(backbone_hidden_size=1536)
    draft._name_or_path = "google/gemma-4-E2B-it-assistant"
    message = mismatch(target_text(), draft)
    assert "'google/gemma-4-E2B-it-assistant'" in message


# --- KV sharing map and per-layer shapes -----------------------------------------------------


def test_kv_source_layers_skip_shared_target_layers() -> None:
    target = target_text(
        num_hidden_layers=6, layer_types=[S, S, S, F, S, F], num_kv_shared_layers=2
    )
    assert kv_source_layers(target, assistant().text_config) == [2, 3]


def test_kv_source_layers_ignore_assistant_kv_sharing_field() -> None:
    rewritten = as_vllm_sees_it(assistant())
    assert kv_source_layers(target_text(), rewritten.text_config) == [2, 3]


def test_layer_attention_shape_per_layer_config() -> None:
    config = target_text(num_global_key_value_heads=1, attention_k_eq_v=True)
    assert layer_attention_shape(config, 0) == (2, 32)
    assert layer_attention_shape(config, 3) == (1, 64)


def legacy_text(**overrides: Any) -> PretrainedConfig:
    """A transformers 5.8-5.14 style text config: flat global_* fields, no per_layer_config."""
    fields: dict[str, Any] = dict(
        model_type="gemma4_text",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, S, S, F],
    )
    fields.update(overrides)
    return cast(PretrainedConfig, SimpleNamespace(**fields))


def test_layer_attention_shape_legacy_fields() -> None:
    assert layer_attention_shape(legacy_text(), 0) == (2, 32)
    assert layer_attention_shape(legacy_text(), 3) == (1, 64)
    # Without attention_k_eq_v the global KV-head count does not apply.
    assert layer_attention_shape(legacy_text(attention_k_eq_v=False), 3) == (2, 64)
    # Without global_head_dim full layers keep head_dim.
    assert layer_attention_shape(legacy_text(global_head_dim=None), 3) == (1, 32)


def test_layer_attention_shape_serialised_per_layer_config() -> None:
    # The sparse JSON form (zero-padded string keys), as an older transformers keeps it.
    config = legacy_text(
        global_head_dim=None,
        per_layer_config={"03": {"head_dim": 64, "num_key_value_heads": 1}},
    )
    assert layer_attention_shape(config, 0) == (2, 32)
    assert layer_attention_shape(config, 3) == (1, 64)


# --- tensor parallelism ----------------------------------------------------------------------


def tp_error(draft: Any, tp: int) -> str:
    with pytest.raises(UnsupportedConfigurationError) as info:
        validate_tensor_parallel(draft, tp)
    return str(info.value)


def test_tensor_parallel_sizes_that_split_the_assistant_pass() -> None:
    # 4 query heads, 2 KV heads, intermediate 128: 2 ranks split everything; 4 ranks hold one
    # query head each over one replicated KV head.
    for tp in (1, 2, 4):
        validate_tensor_parallel(as_vllm_sees_it(assistant()), tp)
    assert supported_tensor_parallel_sizes(assistant()) == [1, 2, 4]


def test_tensor_parallel_size_not_dividing_the_query_heads() -> None:
    message = tp_error(assistant(), 3)
    assert "tensor_parallel_size=3" in message
    assert "num_attention_heads=4" in message and "layer 0" in message
    assert "(1, 2, 4)" in message  # the sizes that would work


def test_tensor_parallel_size_splitting_the_kv_heads_unevenly() -> None:
    # 6 query heads over 3 KV heads: 2 ranks split the queries but not the KV heads (3 is
    # neither a multiple of 2 nor divides it), so a rank's queries would miss their KV head.
    text = dict(num_attention_heads=6, num_key_value_heads=3, intermediate_size=132)
    message = tp_error(assistant(text), 2)
    assert "num_key_value_heads=3" in message and "tensor_parallel_size=2" in message
    assert supported_tensor_parallel_sizes(assistant(text)) == [1, 3, 6]


def test_tensor_parallel_size_not_dividing_the_mlp() -> None:
    message = tp_error(assistant({"intermediate_size": 130}), 4)
    assert "intermediate_size=130" in message and "tensor_parallel_size=4" in message
    assert supported_tensor_parallel_sizes(assistant({"intermediate_size": 130})) == [1, 2]


def test_tensor_parallel_over_k_eq_v_full_layers() -> None:
    # Like Gemma 4 31B: full-attention layers keep fewer KV heads (here 1, replicated on every
    # rank), sliding layers 2 (split over 2 ranks).
    draft = assistant({"attention_k_eq_v": True, "num_global_key_value_heads": 1})
    assert layer_attention_shape(draft.get_text_config(), 1) == (1, 64)
    validate_tensor_parallel(draft, 2)
    assert supported_tensor_parallel_sizes(draft) == [1, 2, 4]


def test_tensor_parallel_error_is_a_value_error() -> None:
    assert issubclass(UnsupportedConfigurationError, ValueError)


# --- token ordering --------------------------------------------------------------------------


def test_token_ordering_permutation_passes() -> None:
    validate_token_ordering(torch.randperm(VOCAB), VOCAB, NUM_CENTROIDS)


def test_token_ordering_duplicates() -> None:
    ordering = torch.arange(VOCAB)
    ordering[:3] = 5
    with pytest.raises(
        AssistantMismatchError, match=r"3 duplicate entries \(of 1 repeated ids\), 3 ids missing"
    ):
        validate_token_ordering(ordering, VOCAB, NUM_CENTROIDS)


def test_token_ordering_all_zeros() -> None:
    with pytest.raises(AssistantMismatchError, match="all zeros") as info:
        validate_token_ordering(torch.zeros(VOCAB, dtype=torch.long), VOCAB, NUM_CENTROIDS)
    assert f"{VOCAB - 1} duplicate entries" in str(info.value)
    assert f"{VOCAB - 1} ids missing" in str(info.value)


def test_token_ordering_wrong_length() -> None:
    with pytest.raises(AssistantMismatchError, match=r"shape \(1024,\), expected \(2048,\)"):
        validate_token_ordering(torch.arange(1024), VOCAB, NUM_CENTROIDS)


def test_token_ordering_float_dtype() -> None:
    with pytest.raises(AssistantMismatchError, match="dtype torch.float32"):
        validate_token_ordering(torch.arange(VOCAB, dtype=torch.float32), VOCAB, NUM_CENTROIDS)


def test_token_ordering_out_of_range() -> None:
    ordering = torch.arange(VOCAB)
    ordering[0] = VOCAB
    with pytest.raises(AssistantMismatchError, match="1 entries out of range"):
        validate_token_ordering(ordering, VOCAB, NUM_CENTROIDS)


def test_read_token_ordering_single_file(tmp_path: Path) -> None:
    ordering = torch.randperm(VOCAB)
    save_file(
        {TOKEN_ORDERING_KEY: ordering, "lm_head.weight": torch.zeros(2, 2)},
        tmp_path / "model.safetensors",
    )
    loaded = read_token_ordering(tmp_path)
    assert loaded is not None and torch.equal(loaded, ordering)


def test_read_token_ordering_sharded(tmp_path: Path) -> None:
    ordering = torch.randperm(VOCAB)
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({TOKEN_ORDERING_KEY: ordering}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {
        "a": "model-00001-of-00002.safetensors",
        TOKEN_ORDERING_KEY: "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = read_token_ordering(str(tmp_path))
    assert loaded is not None and torch.equal(loaded, ordering)


def test_read_token_ordering_absent(tmp_path: Path) -> None:
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    assert read_token_ordering(tmp_path) is None


def test_read_token_ordering_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(AssistantMismatchError, match="does not exist"):
        read_token_ordering(tmp_path / "nope")


# --- RoPE --------------------------------------------------------------------------------------


def rope_with(layer_type: str, **changes: Any) -> dict[str, Any]:
    rope = copy.deepcopy(target_text().rope_parameters)
    rope[layer_type].update(changes)
    return rope


def test_full_attention_rope_mismatch() -> None:
    draft = assistant({"rope_parameters": rope_with(F, rope_theta=10_000.0)})
    message = mismatch(target_text(), as_vllm_sees_it(draft))
    assert "'full_attention'" in message
    assert "'rope_theta': 10000.0" in message and "'rope_theta': 1000000.0" in message


def test_sliding_attention_rope_mismatch() -> None:
    draft = assistant({"rope_parameters": rope_with(S, rope_type="linear", factor=2.0)})
    message = mismatch(target_text(), draft)
    assert "'sliding_attention'" in message and "'linear'" in message and "'default'" in message


def test_rope_only_compared_for_layer_types_the_assistant_uses() -> None:
    # An assistant of one full-attention layer never meets the target's sliding-window keys.
    rope = rope_with(S, rope_theta=1_234.0)
    draft = assistant(
        {
            "rope_parameters": rope,
            "num_hidden_layers": 1,
            "layer_types": [F],
            "num_kv_shared_layers": 1,
        }
    )
    validate_pair(target_text(), draft)
    message = mismatch(target_text(), assistant({"rope_parameters": rope}))
    assert "'sliding_attention'" in message and "1234.0" in message
