"""Random-weight Gemma 4 checkpoints with the shapes of E2B and its assistant, for GPU benchmarks.

Target: hidden 1536, 35 layers (4 sliding : 1 full), 20 KV-shared layers with double-wide MLPs,
per-layer input embeddings (256 per layer over the whole vocab), vocab 262144: ~4.6 B parameters.
Assistant: 4 layers x 256 over the 1536-wide backbone, 2048 centroids, top-k 32. Random weights
accept (almost) no drafts, so a speculative step timed on them is the pure cost of speculating.
Needs a GPU to build in reasonable time (weights are drawn on ``device``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

from gemma4_spec.testing.config_format import write_portable_config
from gemma4_spec.testing.kv_norms import add_missing_k_norms
from gemma4_spec.testing.tiny import E2B_LOGIT_SOFTCAP, is_unit_scale
from gemma4_spec.validation import FULL_ATTENTION as FULL
from gemma4_spec.validation import SLIDING_ATTENTION as SLIDING

VOCAB = 262_144
TARGET_LAYERS = 35
TARGET_KV_SHARED = 20
ASSISTANT_LAYER_TYPES = [SLIDING, SLIDING, SLIDING, FULL]
STD = 0.02


def published_text_config(**overrides: object) -> Gemma4TextConfig:
    """A Gemma 4 text config with the published E2B figures (vocab, heads, head sizes, sliding
    window, soft-cap) under ``overrides``; the other sizes override what differs."""
    fields: dict[str, object] = dict(
        vocab_size=VOCAB,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        final_logit_softcapping=E2B_LOGIT_SOFTCAP,
        max_position_embeddings=32_768,
        initializer_range=STD,
    )
    fields.update(overrides)
    return Gemma4TextConfig(**fields)


def target_config() -> Gemma4TextConfig:
    types = [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(TARGET_LAYERS)]
    return published_text_config(
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=TARGET_LAYERS,
        layer_types=types,
        num_kv_shared_layers=TARGET_KV_SHARED,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=VOCAB,
    )


def assistant_config() -> Gemma4AssistantConfig:
    text = published_text_config(
        hidden_size=256,
        intermediate_size=2048,
        num_hidden_layers=len(ASSISTANT_LAYER_TYPES),
        layer_types=list(ASSISTANT_LAYER_TYPES),
        num_kv_shared_layers=len(ASSISTANT_LAYER_TYPES),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    return Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=1536,
        use_ordered_embeddings=True,
        num_centroids=2048,
        centroid_intermediate_top_k=32,
    )


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if is_unit_scale(name):
            param.fill_(1.0)
        else:
            param.normal_(0.0, STD, generator=gen)
    for name, buf in model.named_buffers():
        if name.endswith("layer_scalar"):
            buf.fill_(1.0)
        elif name.endswith("token_ordering"):
            buf.copy_(torch.randperm(buf.numel(), generator=gen, device=buf.device))


def _build(cls: type, config: object, path: Path, device: str, seed: int) -> Path:
    with torch.device(device):
        model = cls(config)
    model.to(torch.bfloat16)
    _randomise(model, seed)
    model.save_pretrained(path)
    write_portable_config(path)  # readable by every transformers the vLLM range uses
    return path


def _write_config_only(config: Gemma4TextConfig, path: Path) -> Path:
    """The target's config.json alone: vLLM draws its weights (``load_format="dummy"``)."""
    config = copy.deepcopy(config)
    config.architectures = ["Gemma4ForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    write_portable_config(path)
    return path


def build_random_pair(
    root: str | Path,
    target: Gemma4TextConfig,
    assistant: Gemma4AssistantConfig,
    device: str = "cuda",
    seed: int = 0,
    target_weights: bool = True,
) -> tuple[Path, Path]:
    """Write (or reuse) random bf16 ``root/target`` and ``root/assistant`` of these configs,
    weights drawn on ``device``; returns their paths. ``target_weights=False`` writes the
    target's config only, for engines that draw its weights themselves (vLLM's
    ``load_format="dummy"``): targets whose checkpoint would not fit the disk."""
    root = Path(root)
    target_dir, assistant_dir = root / "target", root / "assistant"
    if not (target_dir / "config.json").exists():
        if not target_weights:
            _write_config_only(target, target_dir)
        else:
            _build(Gemma4ForCausalLM, target, target_dir, device, seed)
            add_missing_k_norms(target_dir)
    if not (assistant_dir / "config.json").exists():
        _build(Gemma4AssistantForCausalLM, assistant, assistant_dir, device, seed + 1)
    return target_dir, assistant_dir


def build_e2b_shaped_pair(
    root: str | Path, device: str = "cuda", seed: int = 0
) -> tuple[Path, Path]:
    """Write (or reuse) ``root/target`` and ``root/assistant``; returns their paths."""
    return build_random_pair(root, target_config(), assistant_config(), device, seed)
