"""Pre-load checks that a Gemma 4 target and its MTP assistant belong together.

The assistant ("drafter") has no K/V projections of its own: every one of its attention layers
reads the K/V cache of one target layer, feeds on the target's last hidden state and shares the
target's vocabulary. A wrong pairing therefore does not fail at config time in vLLM; it fails
much later as a shape error deep inside weight loading, KV-cache allocation or an attention
kernel, or, worse, runs and silently drafts garbage (zero acceptance). Everything here runs on
configs (and, for the token ordering, on one small tensor read straight from the checkpoint)
before any weights are loaded, and raises a single :class:`AssistantMismatchError` that names the
offending fields, their values and how to fix it.

Config objects come in several shapes, all handled here:

* the target may be a ``Gemma4TextConfig`` (``gemma4_text``), a multimodal ``Gemma4Config``
  (``gemma4``, with ``.text_config``) or their ``gemma4_unified`` counterparts;
* the assistant may still carry the ``gemma4_assistant`` model type transformers saved, or the
  ``gemma4_mtp`` type vLLM's ``SpeculativeConfig`` rewrites it to (vLLM then also zeroes the
  assistant's ``num_kv_shared_layers``, so that field is never trusted here);
* per-layer attention shapes live in ``per_layer_config`` on transformers >= 5.19 (where reading
  e.g. ``config.head_dim`` on a heterogeneous config raises), and in the flat
  ``global_head_dim`` / ``num_global_key_value_heads`` fields on older releases.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

__all__ = [
    "ASSISTANT_MODEL_TYPES",
    "TARGET_MODEL_TYPES",
    "TOKEN_ORDERING_KEY",
    "AssistantMismatchError",
    "UnsupportedConfigurationError",
    "kv_source_layers",
    "layer_attention_shape",
    "read_token_ordering",
    "supported_tensor_parallel_sizes",
    "validate_pair",
    "validate_tensor_parallel",
    "validate_token_ordering",
]

#: Top-level ``model_type`` values of a Gemma 4 model that can serve as the target.
TARGET_MODEL_TYPES = frozenset({"gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"})
#: ``model_type`` values of the text decoder inside a Gemma 4 target.
_TARGET_TEXT_MODEL_TYPES = frozenset({"gemma4_text", "gemma4_unified_text"})
#: ``model_type`` values of an assistant: as saved by transformers, and after vLLM's rewrite.
ASSISTANT_MODEL_TYPES = frozenset({"gemma4_assistant", "gemma4_unified_assistant", "gemma4_mtp"})
#: The only tensor we read from the assistant checkpoint before loading.
TOKEN_ORDERING_KEY = "masked_embedding.token_ordering"

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"

# The fix for every "this assistant belongs to another target" error is the same.
_PAIR_FIX = (
    "pass the assistant trained for this target, "
    "e.g. google/gemma-4-E2B-it-assistant for google/gemma-4-E2B-it"
)
_MISSING = object()
# Target hidden sizes we can name in the backbone-mismatch error, to point at the right target.
_KNOWN_BACKBONES = {
    1536: "google/gemma-4-E2B-it",
    2560: "google/gemma-4-E4B-it",
    2816: "google/gemma-4-26B-A4B-it",
    5376: "google/gemma-4-31B-it",
}


class AssistantMismatchError(ValueError):
    """The target / assistant pair (or the assistant checkpoint) cannot work together.

    A ``ValueError`` so that vLLM's config-time error handling reports it like its own
    argument errors instead of as an internal crash.
    """


class UnsupportedConfigurationError(ValueError):
    """A vLLM setting that gemma4_mtp drafting cannot run with (e.g. a parallelism that does
    not split the assistant)."""


# --------------------------------------------------------------------------------------------
# Config access helpers
# --------------------------------------------------------------------------------------------


def _read(cfg: Any, name: str, default: Any = None) -> Any:
    """Read a global config attribute, or ``default`` if it is absent.

    On transformers >= 5.19 a heterogeneous config raises (a ``RuntimeError``, which ``getattr``
    with a default does not catch) when a per-layer attribute such as ``head_dim`` is read
    globally. We always want the global value and resolve per-layer overrides ourselves, so we
    go through transformers' own unguarded accessor when the config has one.
    """
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    unguarded = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
    if callable(unguarded):
        return unguarded(name, default)
    return getattr(cfg, name, default)


def _text_config(cfg: Any) -> Any:
    """The decoder text config of a (possibly multimodal or assistant) config."""
    get_text_config = getattr(cfg, "get_text_config", None)
    if callable(get_text_config):
        return get_text_config()
    text_config = _read(cfg, "text_config")
    return cfg if text_config is None else text_config


def _name(cfg: Any, role: str) -> str:
    """``role`` plus the checkpoint name when known, so messages say *which* model is wrong."""
    name_or_path = _read(cfg, "_name_or_path", "") or _read(cfg, "name_or_path", "")
    return f"{role} {name_or_path!r}" if name_or_path else role


def _identity(cfg: Any) -> str:
    """``model_type=..., architectures=...`` of a config, for "wrong kind of model" errors."""
    return f"model_type={_read(cfg, 'model_type')!r}, architectures={_read(cfg, 'architectures')!r}"


def _num_layers(text_config: Any, role: str) -> int:
    num_layers = _read(text_config, "num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise AssistantMismatchError(
            f"The {role} text config has num_hidden_layers={num_layers!r}; expected a positive "
            "integer. Check that the config.json is an unmodified Gemma 4 checkpoint config."
        )
    return num_layers


def _layer_types(text_config: Any, role: str) -> list[str]:
    """The first ``num_hidden_layers`` entries of ``layer_types``; decoder layers only."""
    num_layers = _num_layers(text_config, role)
    layer_types = _read(text_config, "layer_types")
    if layer_types is None or len(layer_types) < num_layers:
        raise AssistantMismatchError(
            f"The {role} text config has layer_types={layer_types!r} for "
            f"num_hidden_layers={num_layers}; every layer needs a type ('{SLIDING_ATTENTION}' or "
            f"'{FULL_ATTENTION}'). Check that the config.json is an unmodified Gemma 4 config."
        )
    return list(layer_types[:num_layers])


def _layer_entry(text_config: Any, layer_idx: int) -> Any:
    """The ``per_layer_config`` entry of one layer, or ``_MISSING`` on pre-5.19 configs.

    ``per_layer_config`` is transformers' sequence view of full per-layer configs (5.19+), but
    a config that went through JSON, or a transformers that does not know the field, holds the
    sparse serialised form instead: ``{"3": {"head_dim": 512}}``, keys possibly zero-padded and
    layers without overrides absent. An absent layer there means "no overrides", hence ``{}``.
    """
    per_layer = _read(text_config, "per_layer_config")
    if per_layer is None:
        return _MISSING
    if isinstance(per_layer, Mapping):
        for key, overrides in per_layer.items():
            if str(key).isdigit() and int(key) == layer_idx:
                return overrides
        return {}
    return per_layer[layer_idx]


def _layer_value(text_config: Any, layer_idx: int, name: str) -> Any:
    """One attribute of one layer: its per-layer override if any, else the global value."""
    entry = _layer_entry(text_config, layer_idx)
    if entry is not _MISSING:
        value = _read(entry, name)
        if value is not None:
            return value
    return _read(text_config, name)


def layer_attention_shape(text_config: PretrainedConfig, layer_idx: int) -> tuple[int, int]:
    """``(num_key_value_heads, head_dim)`` of decoder layer ``layer_idx``.

    Gemma 4 full-attention layers use a larger head (``global_head_dim``) and, for
    ``attention_k_eq_v`` models, fewer KV heads than sliding layers. transformers >= 5.19 stores
    those as ``per_layer_config`` overrides; 5.8-5.14 stored the flat ``global_head_dim`` /
    ``num_global_key_value_heads`` fields instead, which we apply ourselves when no
    ``per_layer_config`` is present.
    """
    num_layers = _num_layers(text_config, "model")
    if not 0 <= layer_idx < num_layers:
        raise IndexError(f"layer_idx={layer_idx} is out of range for {num_layers} layers")

    head_dim = _read(text_config, "head_dim")
    num_kv_heads = _read(text_config, "num_key_value_heads")
    entry = _layer_entry(text_config, layer_idx)
    if entry is not _MISSING:
        head_dim = _read(entry, "head_dim") or head_dim
        num_kv_heads = _read(entry, "num_key_value_heads") or num_kv_heads
    elif _layer_types(text_config, "model")[layer_idx] == FULL_ATTENTION:
        head_dim = _read(text_config, "global_head_dim") or head_dim
        # The global KV-head count only applies to models whose full layers share K and V.
        if _read(text_config, "attention_k_eq_v", False):
            num_kv_heads = _read(text_config, "num_global_key_value_heads") or num_kv_heads

    # Generic transformers fallbacks for configs that leave these unset.
    num_heads = _layer_value(text_config, layer_idx, "num_attention_heads")
    if head_dim is None:
        head_dim = _read(text_config, "hidden_size") // num_heads
    if num_kv_heads is None:
        num_kv_heads = num_heads
    return int(num_kv_heads), int(head_dim)


def kv_source_layers(
    target_text_config: PretrainedConfig, assistant_text_config: PretrainedConfig
) -> list[int]:
    """For each assistant layer, the index of the target layer whose K/V cache it reads.

    An assistant layer of type T attends over the K/V of the *last* target layer of type T that
    computes its own K/V. Target layers past ``num_hidden_layers - num_kv_shared_layers``
    reuse earlier layers' caches, so they are never sources. The assistant's own
    ``num_kv_shared_layers`` is ignored: vLLM rewrites it to 0 before we see it.
    """
    target_types = _layer_types(target_text_config, "target")
    num_shared = _read(target_text_config, "num_kv_shared_layers", 0) or 0
    num_own = len(target_types) - num_shared
    if not 0 < num_own <= len(target_types):
        raise AssistantMismatchError(
            f"The target text config has num_kv_shared_layers={num_shared} with "
            f"num_hidden_layers={len(target_types)}, which leaves no layer with its own K/V "
            "cache for the assistant to read. Check that the target config.json is unmodified."
        )

    last_of_type: dict[str, int] = {}
    for idx, layer_type in enumerate(target_types[:num_own]):
        last_of_type[layer_type] = idx

    sources: list[int] = []
    for idx, layer_type in enumerate(_layer_types(assistant_text_config, "assistant")):
        if layer_type not in last_of_type:
            own_types = dict(Counter(target_types[:num_own]))
            raise AssistantMismatchError(
                f"Assistant layer {idx} is {layer_type!r} and reads K/V from the target's last "
                f"non-KV-shared {layer_type!r} layer, but the target's {num_own} non-KV-shared "
                f"layers (num_hidden_layers={len(target_types)}, num_kv_shared_layers="
                f"{num_shared}) have types {own_types}; {_PAIR_FIX}."
            )
        sources.append(last_of_type[layer_type])
    return sources


# --------------------------------------------------------------------------------------------
# Pair validation
# --------------------------------------------------------------------------------------------


def _check_target(target_config: Any) -> Any:
    """Reject non-Gemma-4 targets; return the target's text config."""
    model_type = _read(target_config, "model_type")
    if model_type in ASSISTANT_MODEL_TYPES:
        raise AssistantMismatchError(
            f"The target is a Gemma 4 assistant ({_identity(target_config)}), which only drafts "
            "for a full model. Pass the full Gemma 4 model as the target and the assistant as "
            "the speculative model, e.g. --model google/gemma-4-E2B-it with "
            "google/gemma-4-E2B-it-assistant as the draft."
        )
    text_config = _text_config(target_config)
    text_type = _read(text_config, "model_type")
    if model_type not in TARGET_MODEL_TYPES or text_type not in _TARGET_TEXT_MODEL_TYPES:
        inner = f", text model_type={text_type!r}" if text_type != model_type else ""
        raise AssistantMismatchError(
            f"The target is not a Gemma 4 model ({_identity(target_config)}{inner}); "
            "Gemma 4 MTP needs a target with model_type in "
            f"{sorted(TARGET_MODEL_TYPES)}. Use a Gemma 4 target, e.g. google/gemma-4-E2B-it, "
            "or a draft method made for this model."
        )
    return text_config


def _check_assistant(assistant_config: Any) -> Any:
    """Reject drafts that are not a Gemma 4 assistant; return the assistant's text config."""
    model_type = _read(assistant_config, "model_type")
    if model_type not in ASSISTANT_MODEL_TYPES:
        hint = (
            " That is a regular Gemma 4 model, not its assistant."
            if model_type in TARGET_MODEL_TYPES
            else ""
        )
        raise AssistantMismatchError(
            f"The draft model is not a Gemma 4 assistant checkpoint: it has "
            f"{_identity(assistant_config)}, expected model_type 'gemma4_assistant'.{hint} "
            f"Pass the target's assistant as the draft model, e.g. "
            "google/gemma-4-E2B-it-assistant for google/gemma-4-E2B-it."
        )
    text_config = _read(assistant_config, "text_config")
    if text_config is None:
        raise AssistantMismatchError(
            f"The assistant config ({_identity(assistant_config)}) has no text_config, so its "
            "decoder shape is unknown. Re-download the assistant checkpoint; its config.json "
            "must contain a text_config section."
        )
    return _text_config(assistant_config)


def _check_backbone(assistant_config: Any, target_text: Any, assistant: str, target: str) -> None:
    """The assistant consumes and produces target hidden states, so the widths must agree."""
    backbone = _read(assistant_config, "backbone_hidden_size")
    hidden_size = _read(target_text, "hidden_size")
    if backbone != hidden_size:
        known = _KNOWN_BACKBONES.get(backbone)
        which = f", as {known} has" if known else ""
        raise AssistantMismatchError(
            f"The {assistant} has backbone_hidden_size={backbone}, but the {target} has "
            f"hidden_size={hidden_size}: the assistant was trained for another Gemma 4 size "
            f"(a target with hidden_size={backbone}{which}); {_PAIR_FIX}."
        )


def _check_vocab(assistant_text: Any, target_text: Any, assistant: str, target: str) -> None:
    """Draft token ids are verified by the target, so both must index the same vocabulary."""
    assistant_vocab = _read(assistant_text, "vocab_size")
    target_vocab = _read(target_text, "vocab_size")
    if assistant_vocab != target_vocab:
        raise AssistantMismatchError(
            f"The {assistant} has text_config.vocab_size={assistant_vocab}, but the {target} "
            f"has vocab_size={target_vocab}, so draft token ids would not name the same tokens; "
            f"{_PAIR_FIX}."
        )


def _check_centroids(assistant_config: Any, assistant_text: Any, assistant: str) -> None:
    """Centroid masking views the vocab as ``[num_centroids, vocab_size // num_centroids]``."""
    if not _read(assistant_config, "use_ordered_embeddings", False):
        return
    vocab_size = _read(assistant_text, "vocab_size")
    num_centroids = _read(assistant_config, "num_centroids")
    top_k = _read(assistant_config, "centroid_intermediate_top_k")
    fix = (
        "Fix num_centroids / centroid_intermediate_top_k in the assistant's config.json, or "
        "re-download the original assistant checkpoint."
    )
    if not isinstance(num_centroids, int) or num_centroids <= 0 or vocab_size % num_centroids:
        raise AssistantMismatchError(
            f"The {assistant} uses ordered embeddings with num_centroids={num_centroids!r}, which "
            f"does not evenly divide text_config.vocab_size={vocab_size} (each centroid must own "
            f"the same number of tokens). {fix}"
        )
    if not isinstance(top_k, int) or not 0 < top_k <= num_centroids:
        raise AssistantMismatchError(
            f"The {assistant} has centroid_intermediate_top_k={top_k!r}; it must satisfy "
            f"0 < centroid_intermediate_top_k <= num_centroids={num_centroids}. {fix}"
        )


def _check_attention(assistant_text: Any, target_text: Any, assistant: str, target: str) -> None:
    """Each assistant layer attends over a target layer's cache: shapes must match exactly."""
    sources = kv_source_layers(target_text, assistant_text)
    assistant_types = _layer_types(assistant_text, "assistant")
    for idx, (layer_type, source) in enumerate(zip(assistant_types, sources, strict=True)):
        own_kv, own_dim = layer_attention_shape(assistant_text, idx)
        src_kv, src_dim = layer_attention_shape(target_text, source)
        diffs = []
        if own_kv != src_kv:
            diffs.append(f"num_key_value_heads={own_kv} vs {src_kv}")
        if own_dim != src_dim:
            diffs.append(f"head_dim={own_dim} vs {src_dim}")
        if layer_type == SLIDING_ATTENTION:
            own_window = _layer_value(assistant_text, idx, "sliding_window")
            src_window = _layer_value(target_text, source, "sliding_window")
            if own_window != src_window:
                diffs.append(f"sliding_window={own_window} vs {src_window}")
        if diffs:
            raise AssistantMismatchError(
                f"Assistant layer {idx} ({layer_type!r}) reads the K/V cache of {target} layer "
                f"{source}, but their attention shapes differ (assistant vs target): "
                f"{', '.join(diffs)}; "
                f"{_k_eq_v_hint(assistant_text, target_text, layer_type, own_kv, src_kv)}"
                f"{_PAIR_FIX}."
            )
        num_heads = _layer_value(assistant_text, idx, "num_attention_heads")
        if num_heads % own_kv:
            raise AssistantMismatchError(
                f"Assistant layer {idx} ({layer_type!r}) has num_attention_heads={num_heads}, "
                f"which is not a multiple of the num_key_value_heads={own_kv} of {target} layer "
                f"{source} whose cache it reads (grouped-query attention needs whole groups); "
                f"{_PAIR_FIX}."
            )


def _k_eq_v_hint(
    assistant_text: Any, target_text: Any, layer_type: str, own_kv: int, src_kv: int
) -> str:
    """Why a full layer's KV heads can differ although the assistant is the right one: the
    target's full layers share K and V (26B-A4B, 31B) with their own KV-head count, and an
    assistant config without ``attention_k_eq_v`` gives its full layers the sliding count."""
    if (
        layer_type != FULL_ATTENTION
        or own_kv == src_kv
        or not _read(target_text, "attention_k_eq_v", False)
        or _read(assistant_text, "attention_k_eq_v", False)
    ):
        return ""
    return (
        "the target's full-attention layers share K and V (attention_k_eq_v: true, "
        f"{src_kv} KV heads), and the assistant's text_config does not say attention_k_eq_v: "
        f"true and num_global_key_value_heads: {src_kv} as the published assistants do; "
        "restore those two fields if the config was edited, otherwise "
    )


def _rope_for_type(text_config: Any, layer_type: str) -> Any:
    """The RoPE parameters layers of ``layer_type`` use, or ``None`` if the config has none.

    Gemma 4 keys ``rope_parameters`` by layer type; a flat dict (one set for every layer) is
    accepted too. ``None`` values are dropped so an explicit unset field equals an absent one.
    """
    rope = _read(text_config, "rope_parameters")
    if not isinstance(rope, Mapping):
        return None
    if SLIDING_ATTENTION in rope or FULL_ATTENTION in rope:
        rope = rope.get(layer_type)
        if not isinstance(rope, Mapping):
            return rope
    return {key: value for key, value in rope.items() if value is not None}


def _check_rope(assistant_text: Any, target_text: Any, assistant: str, target: str) -> None:
    """The assistant's queries meet keys the target rotated: RoPE must match per layer type.

    A mismatch raises no error anywhere later; it only makes every draft (nearly) wrong.
    Skipped when either config has no ``rope_parameters`` (older flat ``rope_theta`` fields).
    """
    if _read(assistant_text, "rope_parameters") is None:
        return
    if _read(target_text, "rope_parameters") is None:
        return
    for layer_type in dict.fromkeys(_layer_types(assistant_text, "assistant")):
        own = _rope_for_type(assistant_text, layer_type)
        src = _rope_for_type(target_text, layer_type)
        if own != src:
            raise AssistantMismatchError(
                f"The {layer_type!r} layers of the {assistant} use rope_parameters={own!r}, but "
                f"the {layer_type!r} layers of the {target}, whose K/V cache they read, use "
                f"rope_parameters={src!r}: the assistant's queries would be rotated differently "
                f"from the target's keys and almost no draft would be accepted; {_PAIR_FIX}."
            )


def validate_pair(target_config: PretrainedConfig, assistant_config: PretrainedConfig) -> None:
    """Raise :class:`AssistantMismatchError` unless the assistant can draft for the target.

    Checks, in order (the first failure is reported, most fundamental first): the target is a
    Gemma 4 model; the draft is a Gemma 4 assistant; ``backbone_hidden_size`` equals the
    target's ``hidden_size``; the vocabularies match; the centroid-masking parameters are
    consistent; every assistant layer finds a target layer to read K/V from whose
    ``(num_key_value_heads, head_dim)`` (and sliding window) match its own; and the RoPE
    parameters of each layer type the assistant uses equal the target's for that type.
    """
    target_text = _check_target(target_config)
    assistant_text = _check_assistant(assistant_config)
    target = _name(target_config, "target")
    assistant = _name(assistant_config, "assistant")
    _check_backbone(assistant_config, target_text, assistant, target)
    _check_vocab(assistant_text, target_text, assistant, target)
    _check_centroids(assistant_config, assistant_text, assistant)
    _check_attention(assistant_text, target_text, assistant, target)
    _check_rope(assistant_text, target_text, assistant, target)


# --------------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------------


def _tensor_parallel_problem(assistant_text: Any, tensor_parallel_size: int) -> str | None:
    """What keeps the assistant's layers from splitting over ``tensor_parallel_size`` ranks, as
    the model shards them (``models/gemma4_mtp.py``), or ``None``.

    Each rank computes ``num_attention_heads / tp`` query heads (q_proj by columns, o_proj by
    rows) and an equal share of the MLP's ``intermediate_size``. Its queries read the KV heads
    the target keeps on the same rank: ``num_key_value_heads / tp`` of them, or one replicated
    head when ``tp`` is a multiple of ``num_key_value_heads`` (vLLM's rule for the target's own
    K/V projection)."""
    tp = tensor_parallel_size
    for idx, layer_type in enumerate(_layer_types(assistant_text, "assistant")):
        heads = _layer_value(assistant_text, idx, "num_attention_heads")
        kv_heads, _ = layer_attention_shape(assistant_text, idx)
        where = f"assistant layer {idx} ({layer_type!r})"
        if heads % tp:
            return (
                f"{where} has num_attention_heads={heads}, which tensor_parallel_size={tp} does "
                "not divide (each rank computes an equal share of the query heads)"
            )
        if kv_heads % tp and tp % kv_heads:
            return (
                f"{where} reads a target cache of num_key_value_heads={kv_heads}, which "
                f"tensor_parallel_size={tp} neither divides nor is a multiple of (each rank "
                "reads its share of the target's KV heads, or one replicated head)"
            )
    intermediate = _read(assistant_text, "intermediate_size")
    if isinstance(intermediate, int) and intermediate % tp:
        return (
            f"the assistant's intermediate_size={intermediate} is not divisible by "
            f"tensor_parallel_size={tp} (each rank computes an equal share of the MLP)"
        )
    return None


def supported_tensor_parallel_sizes(assistant_config: PretrainedConfig) -> list[int]:
    """The tensor-parallel sizes the assistant splits over, from 1 to its largest head count."""
    assistant_text = _text_config(assistant_config)
    most = max(
        _layer_value(assistant_text, idx, "num_attention_heads")
        for idx in range(_num_layers(assistant_text, "assistant"))
    )
    return [tp for tp in range(1, most + 1) if _tensor_parallel_problem(assistant_text, tp) is None]


def validate_tensor_parallel(assistant_config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Raise :class:`UnsupportedConfigurationError` unless the assistant's attention heads, the
    target KV heads it reads and its MLP split evenly over ``tensor_parallel_size`` ranks (the
    draft runs on the target's tensor-parallel ranks)."""
    if tensor_parallel_size <= 1:
        return
    problem = _tensor_parallel_problem(_text_config(assistant_config), tensor_parallel_size)
    if problem is None:
        return
    sizes = ", ".join(str(n) for n in supported_tensor_parallel_sizes(assistant_config))
    raise UnsupportedConfigurationError(
        f"gemma4_mtp cannot run the {_name(assistant_config, 'assistant')} with "
        f"tensor_parallel_size={tensor_parallel_size}: {problem}. The assistant drafts on the "
        f"target's tensor-parallel ranks, so pick a --tensor-parallel-size it splits over "
        f"({sizes}) that the target accepts too."
    )


# --------------------------------------------------------------------------------------------
# Token ordering (centroid masking)
# --------------------------------------------------------------------------------------------


def validate_token_ordering(
    token_ordering: torch.Tensor, vocab_size: int, num_centroids: int
) -> None:
    """Raise unless ``token_ordering`` is a permutation of ``range(vocab_size)``.

    Centroid masking views it as ``[num_centroids, vocab_size // num_centroids]`` token ids and
    scatters draft logits to those ids; a non-permutation makes some tokens undraftable and
    others double-counted, which no later step detects.
    """
    fix = (
        "Use the original assistant checkpoint, or re-export it with its real "
        f"{TOKEN_ORDERING_KEY}."
    )
    if not isinstance(token_ordering, torch.Tensor):
        raise AssistantMismatchError(
            f"{TOKEN_ORDERING_KEY} must be a tensor, got {type(token_ordering).__name__}. {fix}"
        )
    shape = tuple(token_ordering.shape)
    if token_ordering.dim() != 1 or shape[0] != vocab_size:
        raise AssistantMismatchError(
            f"{TOKEN_ORDERING_KEY} has shape {shape}, expected ({vocab_size},) for "
            f"vocab_size={vocab_size}: the checkpoint was saved for another vocabulary. {fix}"
        )
    dtype = token_ordering.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise AssistantMismatchError(
            f"{TOKEN_ORDERING_KEY} has dtype {dtype}, expected an integer dtype (token ids). {fix}"
        )
    if num_centroids <= 0 or vocab_size % num_centroids:
        raise AssistantMismatchError(
            f"{TOKEN_ORDERING_KEY} cannot be split into num_centroids={num_centroids} equal "
            f"groups of vocab_size={vocab_size} tokens. Fix num_centroids in the assistant's "
            "config.json, or re-download the original assistant checkpoint."
        )

    ids = token_ordering.detach().to(device="cpu", dtype=torch.long)
    in_range = (ids >= 0) & (ids < vocab_size)
    out_of_range = int((~in_range).sum())
    counts = torch.bincount(ids[in_range], minlength=vocab_size)
    missing = int((counts == 0).sum())
    repeated_ids = int((counts > 1).sum())
    extra_entries = int((counts - 1).clamp(min=0).sum())
    if missing == 0 and out_of_range == 0:
        return  # vocab_size ids, all in range, none missing: a permutation.
    # transformers registers this buffer as zeros, so a model saved before the ordering was
    # filled in (e.g. re-initialised or converted without it) carries all zeros.
    origin = (
        "It is all zeros: transformers initialises it to zeros, so this checkpoint was saved "
        "without setting it and is unusable."
        if bool((ids == 0).all())
        else "Note that transformers initialises it to zeros, so a checkpoint saved without "
        "setting it is unusable."
    )
    raise AssistantMismatchError(
        f"{TOKEN_ORDERING_KEY} is not a permutation of range({vocab_size}): {extra_entries} "
        f"duplicate entries (of {repeated_ids} repeated ids), {missing} ids missing, "
        f"{out_of_range} entries out of range. {origin} {fix}"
    )


def _safetensors_files(directory: Path) -> list[Path]:
    """The shard(s) that can hold the token ordering: the indexed one if sharded, else all."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(directory.glob("*.safetensors"))
    files: list[Path] = []
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AssistantMismatchError(
                f"Cannot read the weight_map of {index} ({exc}). Re-download the assistant "
                "checkpoint."
            ) from exc
        shard = weight_map.get(TOKEN_ORDERING_KEY)
        if shard is not None and directory / shard not in files:
            files.append(directory / shard)
    return files


def read_token_ordering(assistant_dir: str | Path) -> torch.Tensor | None:
    """Read only ``masked_embedding.token_ordering`` from a local assistant checkpoint.

    ``safe_open`` parses just the header and the one tensor, so this is cheap even for large
    checkpoints and can run before vLLM loads anything. Returns ``None`` when the checkpoint
    has no such tensor (e.g. an assistant without ordered embeddings).
    """
    directory = Path(assistant_dir)
    if not directory.is_dir():
        raise AssistantMismatchError(
            f"The assistant checkpoint directory {str(directory)!r} does not exist. Pass a local "
            "directory holding the assistant's config.json and *.safetensors (download it first)."
        )
    files = _safetensors_files(directory)
    if not files and not any(directory.glob("*.safetensors.index.json")):
        raise AssistantMismatchError(
            f"The assistant checkpoint directory {str(directory)!r} has no *.safetensors files. "
            "Download the assistant checkpoint in safetensors format."
        )
    for path in files:
        if not path.is_file():
            raise AssistantMismatchError(
                f"The safetensors index of {str(directory)!r} maps {TOKEN_ORDERING_KEY} to "
                f"{path.name}, which is missing. Re-download the assistant checkpoint."
            )
        with safe_open(str(path), framework="pt") as handle:
            if TOKEN_ORDERING_KEY in handle.keys():
                return handle.get_tensor(TOKEN_ORDERING_KEY)
    return None
