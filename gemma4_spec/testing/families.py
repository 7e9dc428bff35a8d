"""Target + assistant pairs shaped like the other published Gemma 4 sizes: E4B, 26B-A4B, 31B.

E2B-like pairs come from ``tiny.py`` / ``e2b_shaped.py``. What sets the other sizes apart, and
what every shape here keeps (tiny widths, same structure):

========  ===========================  ===========  ======  =========  ========  ===========
family    layers (sliding : full)      KV heads     k_eq_v  KV-shared  MLP       draft head
========  ===========================  ===========  ======  =========  ========  ===========
E4B       42, 5:1 (tiny 12)            2 / 2        no      18 (6)     dense     centroids
26B-A4B   30, 5:1 (tiny 12)            8 / 2 (4/1)  yes     none       dense +   full vocab
                                                                       MoE
31B       60, 5:1 (tiny 12)            16 / 4 (4/1) yes     none       dense     full vocab
========  ===========================  ===========  ======  =========  ========  ===========

KV heads are sliding / full layers'. 26B-A4B's MoE has 128 experts, top 8 (tiny: 4, top 2) beside
its dense MLP. E4B also has per-layer input embeddings, and its assistant has half the target's
query heads (4 of 8). The assistants of 26B-A4B and 31B are 1024 wide over 2816- and 5376-wide
backbones. Every assistant layer reads the K/V of the target's last layer of its type that owns a
cache (E4B: the last layers before the KV-shared ones; 26B-A4B, 31B: the last two layers).

``build_family_pair`` writes a random tiny pair (float32, CPU, seconds) in the flat config form
every supported transformers reads, with a "copy" assistant (drafts its input token again, see
``tiny.py``) so that some drafts are accepted and most are rejected. ``real_shape_configs`` gives
the published shapes, and ``build_real_shape_pair`` random bf16 weights of them on a GPU, for
benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from transformers import Gemma4AssistantConfig, Gemma4TextConfig

from gemma4_spec.testing.e2b_shaped import build_random_pair, published_text_config
from gemma4_spec.testing.tiny import (
    FULL,
    SLIDING,
    AssistantShape,
    assistant_config_for,
    build_tiny_assistant,
    build_tiny_target,
)

__all__ = [
    "FAMILIES",
    "Family",
    "build_family_pair",
    "build_real_shape_pair",
    "gpu_family_prompts",
    "real_shape_configs",
]

FAMILIES = ("e4b", "26b-a4b", "31b")
GPU_PROMPT_LENGTHS = (5, 21, 33, 40)


def gpu_family_prompts() -> list[list[int]]:
    """The prompts of the GPU family test (``tests/test_gpu_families.py``), which the near-tie
    test's recorded H200 tokens continue (``tests/test_near_ties.py``): one place for both."""
    rng = random.Random(4321)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in GPU_PROMPT_LENGTHS]


def _five_to_one(num_layers: int) -> tuple[str, ...]:
    """Gemma 4's 5:1 pattern: every sixth layer full attention (the last one too)."""
    return tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class Family:
    """One size's structure, at some widths."""

    layer_types: tuple[str, ...]
    # Further Gemma4TextConfig fields of the target (widths, heads, k_eq_v, MoE).
    target: Mapping[str, Any]
    assistant: AssistantShape = AssistantShape()
    centroids: bool = False
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0


# 26B-A4B's and 31B's full-attention layers share K and V, with fewer KV heads than sliding ones.
_K_EQ_V = dict(attention_k_eq_v=True)
# The assistants of 26B-A4B and 31B.
_LARGE_ASSISTANT = AssistantShape(
    hidden_size=1024,
    intermediate_size=8192,
    layer_types=(SLIDING, SLIDING, SLIDING, FULL),
    initializer_range=0.02,
)

# The published figures (config.json of google/gemma-4-E4B-it, -26B-A4B-it, -31B-it and their
# assistants).
REAL: Mapping[str, Family] = MappingProxyType(
    {
        "e4b": Family(
            layer_types=_five_to_one(42),
            target=dict(hidden_size=2560, intermediate_size=10240, num_key_value_heads=2),
            assistant=AssistantShape(
                hidden_size=256,
                intermediate_size=2048,
                layer_types=_LARGE_ASSISTANT.layer_types,
                num_attention_heads=4,
                num_centroids=2048,
                centroid_top_k=32,
                initializer_range=0.02,
            ),
            centroids=True,
            num_kv_shared_layers=18,
            hidden_size_per_layer_input=256,
        ),
        "26b-a4b": Family(
            layer_types=_five_to_one(30),
            target=dict(
                hidden_size=2816,
                intermediate_size=2112,
                num_attention_heads=16,
                num_key_value_heads=8,
                num_global_key_value_heads=2,
                sliding_window=1024,
                enable_moe_block=True,
                num_experts=128,
                top_k_experts=8,
                moe_intermediate_size=704,
                **_K_EQ_V,
            ),
            assistant=_LARGE_ASSISTANT,
        ),
        "31b": Family(
            layer_types=_five_to_one(60),
            target=dict(
                hidden_size=5376,
                intermediate_size=21504,
                num_attention_heads=32,
                num_key_value_heads=16,
                num_global_key_value_heads=4,
                sliding_window=1024,
                **_K_EQ_V,
            ),
            assistant=_LARGE_ASSISTANT,
        ),
    }
)

# Tiny versions: 12 layers, the tiny builder's vocab (2048), head sizes (32 / 64) and sliding
# window (16); backbones wider than the 64-wide assistant by ratios near the real ones. 8 query
# heads, so that 26B-A4B's and 31B's KV heads keep the real split: half as many as query heads on
# sliding layers, an eighth on full ones.
_TINY_K_EQ_V_HEADS = dict(
    num_attention_heads=8, num_key_value_heads=4, num_global_key_value_heads=1, **_K_EQ_V
)
TINY: Mapping[str, Family] = MappingProxyType(
    {
        "e4b": Family(
            layer_types=_five_to_one(12),
            target=dict(num_attention_heads=8, num_key_value_heads=2),
            assistant=AssistantShape(num_attention_heads=4),
            centroids=True,
            num_kv_shared_layers=6,
            hidden_size_per_layer_input=16,
        ),
        "26b-a4b": Family(
            layer_types=_five_to_one(12),
            target=dict(
                # vLLM's CPU MoE kernels need widths divisible by 32.
                hidden_size=192,
                intermediate_size=128,
                enable_moe_block=True,
                num_experts=4,
                top_k_experts=2,
                moe_intermediate_size=64,
                **_TINY_K_EQ_V_HEADS,
            ),
        ),
        "31b": Family(
            layer_types=_five_to_one(12),
            target=dict(hidden_size=256, intermediate_size=512, **_TINY_K_EQ_V_HEADS),
        ),
    }
)


def _family(table: Mapping[str, Family], family: str) -> Family:
    if family not in table:
        raise ValueError(f"unknown Gemma 4 family {family!r}; expected one of {FAMILIES}")
    return table[family]


def build_family_pair(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    centroids: bool | None = None,
) -> tuple[Path, Path]:
    """Write a random tiny ``out_dir/target`` (``gemma4_text``) shaped like ``family`` and its
    "copy" assistant ``out_dir/assistant``; returns both paths. Deterministic from ``seed``.

    ``centroids`` gives the assistant the other draft head than the family's own (None keeps
    it), e.g. a full-vocabulary E4B assistant, which vLLM's in-tree version runs on CPU."""
    shape = _family(TINY, family)
    out = Path(out_dir)
    target = build_tiny_target(
        out / "target",
        seed=seed,
        dtype=dtype,
        num_hidden_layers=len(shape.layer_types),
        layer_types=shape.layer_types,
        num_kv_shared_layers=shape.num_kv_shared_layers,
        hidden_size_per_layer_input=shape.hidden_size_per_layer_input,
        **shape.target,
    )
    assistant = build_tiny_assistant(
        out / "assistant",
        target,
        centroids=shape.centroids if centroids is None else centroids,
        style="copy",
        seed=seed,
        dtype=dtype,
        shape=shape.assistant,
    )
    return target, assistant


def real_shape_configs(family: str) -> tuple[Gemma4TextConfig, Gemma4AssistantConfig]:
    """The published target text config and assistant config of ``family``."""
    shape = _family(REAL, family)
    per_layer_input = shape.hidden_size_per_layer_input
    target = published_text_config(
        num_hidden_layers=len(shape.layer_types),
        layer_types=list(shape.layer_types),
        num_kv_shared_layers=shape.num_kv_shared_layers,
        hidden_size_per_layer_input=per_layer_input,
        vocab_size_per_layer_input=published_text_config().vocab_size if per_layer_input else 0,
        **shape.target,
    )
    return target, assistant_config_for(target, shape.centroids, shape.assistant)


def build_real_shape_pair(
    family: str,
    root: str | Path,
    device: str = "cuda",
    seed: int = 0,
    target_weights: bool = True,
) -> tuple[Path, Path]:
    """Write (or reuse) random bf16 ``root/target`` and ``root/assistant`` of ``family``'s
    published shapes, drawn on ``device`` (a GPU: the targets have 8 to 31 B parameters);
    ``target_weights=False``: the target's config only (``build_random_pair``)."""
    target, assistant = real_shape_configs(family)
    return build_random_pair(root, target, assistant, device, seed, target_weights)
