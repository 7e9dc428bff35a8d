"""Random tiny Gemma 4 target + assistant checkpoints (Hugging Face format) for tests and demos.

Real Gemma 4 checkpoints are gigabytes; these are a few megabytes, load in well under a second and
use transformers' own config and model classes, so they exercise the same loading paths (vLLM's
and transformers') as real ones. They carry no tokenizer: run vLLM with
``skip_tokenizer_init=True`` and ``prompt_token_ids``.

Everything is deterministic from ``seed``: we fill every tensor ourselves from a private
``torch.Generator`` (the caller's global RNG is left untouched), so equal seeds give byte-identical
safetensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    PreTrainedConfig,
    PreTrainedModel,
)

from gemma4_spec.testing.config_format import write_portable_config
from gemma4_spec.training.clustering import balanced_assign
from gemma4_spec.validation import FULL_ATTENTION as FULL
from gemma4_spec.validation import SLIDING_ATTENTION as SLIDING
from gemma4_spec.validation import layer_attention_shape

__all__ = [
    "AssistantShape",
    "AssistantStyle",
    "E2B_LIKE_LAYER_TYPES",
    "FULL",
    "HFDraftStep",
    "INIT_STD",
    "SLIDING",
    "assistant_config_for",
    "build_tiny_assistant",
    "build_tiny_e2b_like_target",
    "build_tiny_pair",
    "build_tiny_target",
    "default_layer_types",
    "hf_draft_step",
    "hf_greedy_tokens",
    "is_unit_scale",
    "reference_model",
    "target_text_config",
]

AssistantStyle = Literal["random", "copy"]
_Model = TypeVar("_Model", bound=PreTrainedModel)

VOCAB_SIZE = 2048
TARGET_HIDDEN = 128
TARGET_INTERMEDIATE = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
GLOBAL_HEAD_DIM = 64
SLIDING_WINDOW = 16

# E2B-like target: per-layer input embeddings (PLE), 2 KV-shared last layers with double-wide MLPs.
E2B_LIKE_LAYER_TYPES = (SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL)
E2B_LIKE_KV_SHARED_LAYERS = 2
E2B_LIKE_PER_LAYER_INPUT = 16
# Gain of the post_per_layer_input_norm of each layer. At 1 (a norm's default) every layer adds a
# unit-RMS per-layer-input term to the residual stream, which drowns the input token's pull: greedy
# runs then repeat a token in only ~2% of steps (~6% without per-layer inputs; measured over seeds,
# 48 greedy tokens), so a "copy" assistant sees almost no accepted drafts. 0.3 restores ~6%.
_PER_LAYER_INPUT_GAIN = 0.3
# Its tiny vision tower (never run: text-only prompts). pooling 3 x patch 4 = 12-pixel units;
# default_output_length is the soft-token budget per image that vLLM's Gemma 4 reads from it.
VISION_HIDDEN = 32
VISION_INTERMEDIATE = 64
VISION_HEADS = 2
VISION_HEAD_DIM = 16
VISION_PATCH = 4
VISION_POSITIONS = 64
VISION_SOFT_TOKENS = 16

ASSISTANT_HIDDEN = 64
ASSISTANT_INTERMEDIATE = 128
ASSISTANT_LAYER_TYPES = (SLIDING, FULL)
NUM_CENTROIDS = 64
CENTROID_TOP_K = 8

# Init std of every random matrix. transformers' default (0.02) already gives varied greedy
# output, but a random target then repeats a token in only ~2-6% of greedy steps; from 0.05 up,
# greedy runs collapse into one token repeated. 0.03 (measured over seeds, 4- and 6-layer targets,
# 64 greedy tokens) repeats in ~6-17% of steps and never collapses, so the "copy" assistant gets a
# mix of accepted and rejected drafts. (Larger std lets the sqrt(H)-scaled token embedding compete
# with the unit-RMS post-normed sub-layer outputs, which pulls the prediction towards the input.)
INIT_STD = 0.03

# "copy" assistant: RMS of its embedding rows (= tied lm_head), the RMS of the target-hidden half of
# pre_projection's output relative to the token half, and the gain of its post-attention /
# post-feedforward norms. The last two are small but non-zero so that attention over the shared
# KV, the MLPs and the hidden-state input all still affect the output a little (a test comparing
# an implementation against transformers sees every path) without breaking the copy behaviour.
_COPY_EMBED_RMS = 0.1
_COPY_HIDDEN_MIX = 0.2
_COPY_LAYER_GAIN = 0.1

_ROUTER_PROJ = "router.proj.weight"

_TARGET_SALT = 0x7A5
_ASSISTANT_SALT = 0xA55


def default_layer_types(num_hidden_layers: int) -> list[str]:
    """Gemma-like pattern: every 4th layer and the last one are full attention, the rest sliding."""
    return [
        FULL if (i + 1) % 4 == 0 or i == num_hidden_layers - 1 else SLIDING
        for i in range(num_hidden_layers)
    ]


def _generator(seed: int, salt: int) -> torch.Generator:
    """A private RNG per (seed, model kind), so target and assistant draw different streams."""
    return torch.Generator().manual_seed(seed * 1_000_003 + salt)


def is_unit_scale(name: str) -> bool:
    """Parameters that random checkpoints set to 1: norm gains and a MoE router's input and
    per-expert output scales (random values there would flip or silence layers at random)."""
    return name.endswith(("norm.weight", "router.scale", "router.per_expert_scale"))


def _fill_random(model: torch.nn.Module, gen: torch.Generator, std: float) -> None:
    """Overwrite every parameter: norms and router scales 1, router projections N(0, 1), other
    matrices N(0, std), in a fixed name order.

    A router drawn at ``std`` scores every expert almost alike, so a float32 rounding difference
    between two batch shapes could swap an expert in or out and change the output; N(0, 1)
    scores (the router's input is RMS-normed and scaled by 1/sqrt(hidden)) keep each choice
    clear of such ties."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if is_unit_scale(name):
                param.fill_(1.0)
            elif name.endswith(_ROUTER_PROJ):
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.fill_(1.0)


def _construct(cls: type[_Model], config: PreTrainedConfig) -> _Model:
    """Build a model in float32 without consuming the caller's global RNG (we re-fill it anyway)."""
    with torch.random.fork_rng(devices=[]):
        model = cls(config)
    model.to(torch.float32)
    model.eval()
    return model


def _save(model: PreTrainedModel, path: Path, dtype: torch.dtype) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype)  # casts floating tensors only; token_ordering stays int64
    model.save_pretrained(path)
    write_portable_config(path)  # readable by every transformers the vLLM range uses
    return path


def _read_tensor(path: Path, key: str) -> torch.Tensor:
    """Read one tensor of a (possibly sharded) safetensors checkpoint as float32."""
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if key in handle.keys():
                return handle.get_tensor(key).to(torch.float32)
    raise KeyError(f"{key} not found in {path}")


def target_text_config(
    num_hidden_layers: int,
    layer_types: Sequence[str] | None,
    num_kv_shared_layers: int,
    *,
    hidden_size_per_layer_input: int = 0,
    use_double_wide_mlp: bool = False,
    **fields: Any,
) -> Gemma4TextConfig:
    """The tiny target's text config; ``fields`` are further ``Gemma4TextConfig`` arguments over
    the tiny defaults (e.g. ``hidden_size``, ``attention_k_eq_v``, the MoE sizes)."""
    types = list(layer_types) if layer_types is not None else default_layer_types(num_hidden_layers)
    if len(types) != num_hidden_layers:
        raise ValueError(f"{len(types)} layer_types for {num_hidden_layers} layers")
    if types[-1] != FULL:
        raise ValueError("the last Gemma 4 layer must be full attention")
    if not 0 <= num_kv_shared_layers < num_hidden_layers:
        raise ValueError(f"num_kv_shared_layers must be in [0, {num_hidden_layers})")
    owners = set(types[: num_hidden_layers - num_kv_shared_layers])
    if {SLIDING, FULL} - owners:
        # KV-shared layers and the assistant read the last non-shared layer of each type.
        raise ValueError("the non-KV-shared layers must include a sliding and a full layer")
    defaults: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=TARGET_HIDDEN,
        intermediate_size=TARGET_INTERMEDIATE,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        initializer_range=INIT_STD,
    )
    vocab = fields.get("vocab_size", VOCAB_SIZE)
    return Gemma4TextConfig(
        **{**defaults, **fields},
        num_hidden_layers=num_hidden_layers,
        hidden_size_per_layer_input=hidden_size_per_layer_input,
        vocab_size_per_layer_input=vocab if hidden_size_per_layer_input else 0,
        layer_types=types,
        num_kv_shared_layers=num_kv_shared_layers,
        use_double_wide_mlp=use_double_wide_mlp,
    )


def build_tiny_target(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_hidden_layers: int = 4,
    layer_types: Sequence[str] | None = None,
    num_kv_shared_layers: int = 0,
    hidden_size_per_layer_input: int = 0,
    **fields: Any,
) -> Path:
    """Write a random tiny ``gemma4_text`` target (Gemma4ForCausalLM) to ``path``.

    Default: 4 layers [sliding x3, full], hidden 128, vocab 2048, sliding window 16, head_dim 32
    (sliding) / 64 (full). ``num_kv_shared_layers`` > 0 makes the last layers reuse the KV of the
    last earlier layer of their type, as in real Gemma 4 E2B/E4B targets (e.g. 6 layers, 2 shared).
    ``hidden_size_per_layer_input`` > 0 adds per-layer input embeddings over the whole vocab;
    ``fields`` are further ``Gemma4TextConfig`` arguments (see ``target_text_config``).
    """
    config = target_text_config(
        num_hidden_layers,
        layer_types,
        num_kv_shared_layers,
        hidden_size_per_layer_input=hidden_size_per_layer_input,
        **fields,
    )
    model = _construct(Gemma4ForCausalLM, config)
    _fill_random(model, _generator(seed, _TARGET_SALT), INIT_STD)
    if hidden_size_per_layer_input:
        _damp_per_layer_inputs(model.model)
    return _save(model, Path(path), dtype)


def _damp_per_layer_inputs(text_model: torch.nn.Module) -> None:
    """Set every layer's per-layer-input gain to ``_PER_LAYER_INPUT_GAIN`` (see there)."""
    with torch.no_grad():
        for layer in text_model.layers:
            layer.post_per_layer_input_norm.weight.fill_(_PER_LAYER_INPUT_GAIN)


def _vision_config() -> Gemma4VisionConfig:
    return Gemma4VisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=VISION_HEADS,
        num_key_value_heads=VISION_HEADS,
        head_dim=VISION_HEAD_DIM,
        patch_size=VISION_PATCH,
        position_embedding_size=VISION_POSITIONS,
        default_output_length=VISION_SOFT_TOKENS,
        initializer_range=INIT_STD,
    )


# The real E2B/E4B checkpoints' final_logit_softcapping.
E2B_LOGIT_SOFTCAP = 30.0


def build_tiny_e2b_like_target(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    multimodal: bool = True,
) -> Path:
    """Write a random tiny target shaped like Gemma 4 E2B/E4B (e.g. google/gemma-4-E2B-it).

    Widths, heads, vocab and sliding window are the default tiny target's; on top it has what real
    E2B/E4B text models have: per-layer input embeddings (``hidden_size_per_layer_input`` 16 over
    the whole vocab), 6 layers [s, s, s, f, s, f] whose last 2 reuse the KV of layers 2 and 3
    (``num_kv_shared_layers`` 2), double-wide MLPs on those KV-shared layers, and final logits
    soft-capped at ``E2B_LOGIT_SOFTCAP`` (transformers' default config has no cap). With
    ``multimodal`` (the real checkpoints' layout) it is a ``gemma4`` config and a
    ``Gemma4ForConditionalGeneration`` with a 1-layer vision tower and no audio tower, its text
    weights under ``model.language_model.``; otherwise a ``gemma4_text`` ``Gemma4ForCausalLM``.
    Equal seeds give equal text weights in both layouts.
    """
    text_config = target_text_config(
        len(E2B_LIKE_LAYER_TYPES),
        E2B_LIKE_LAYER_TYPES,
        E2B_LIKE_KV_SHARED_LAYERS,
        hidden_size_per_layer_input=E2B_LIKE_PER_LAYER_INPUT,
        use_double_wide_mlp=True,
        final_logit_softcapping=E2B_LOGIT_SOFTCAP,
    )
    gen = _generator(seed, _TARGET_SALT)
    model: PreTrainedModel
    if multimodal:
        config = Gemma4Config(
            text_config=text_config,
            vision_config=_vision_config(),
            audio_config=None,
            initializer_range=INIT_STD,
        )
        wrapper = _construct(Gemma4ForConditionalGeneration, config)
        text_model = wrapper.model.language_model
        # Text weights first, from the same stream as the text-only layout; then the vision side.
        for part in (text_model, wrapper.model.vision_tower, wrapper.model.embed_vision):
            _fill_random(part, gen, INIT_STD)
        model = wrapper
    else:
        causal_lm = _construct(Gemma4ForCausalLM, text_config)
        text_model = causal_lm.model
        _fill_random(causal_lm, gen, INIT_STD)
        model = causal_lm
    _damp_per_layer_inputs(text_model)
    return _save(model, Path(path), dtype)


def _target_text_config(target_dir: Path) -> Gemma4TextConfig:
    """The text config of a target checkpoint: its own, or ``text_config`` of a ``gemma4`` one."""
    config = AutoConfig.from_pretrained(target_dir).get_text_config()
    if not isinstance(config, Gemma4TextConfig):
        raise ValueError(f"{target_dir} is not a Gemma 4 target ({type(config).__name__})")
    return config


def _target_embed(target_dir: Path) -> torch.Tensor:
    """The target's token embedding, text-only (``model.``) or multimodal layout."""
    for key in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        try:
            return _read_tensor(target_dir, key)
        except KeyError:
            continue
    raise KeyError(f"no token embedding found in {target_dir}")


@dataclass(frozen=True)
class AssistantShape:
    """An assistant's own sizes; everything it shares with the target is read from the target."""

    hidden_size: int = ASSISTANT_HIDDEN
    intermediate_size: int = ASSISTANT_INTERMEDIATE
    layer_types: tuple[str, ...] = ASSISTANT_LAYER_TYPES
    # None: as many query heads as the target (real assistants may have fewer).
    num_attention_heads: int | None = None
    num_centroids: int = NUM_CENTROIDS
    centroid_top_k: int = CENTROID_TOP_K
    initializer_range: float = INIT_STD


def assistant_config_for(
    target: Gemma4TextConfig, centroids: bool, shape: AssistantShape = AssistantShape()
) -> Gemma4AssistantConfig:
    """Same vocab and attention geometry as the target, so the assistant can read its KV."""
    # head_dim is per layer type (transformers >= 5.15 refuses the ambiguous global read).
    kv_heads, head_dim = layer_attention_shape(target, target.layer_types.index(SLIDING))
    global_kv_heads, global_head_dim = layer_attention_shape(target, target.layer_types.index(FULL))
    # Full layers of attention_k_eq_v targets have their own KV-head count; the flat form says it
    # as num_global_key_value_heads, which transformers applies to k_eq_v configs only.
    k_eq_v: dict[str, Any] = (
        dict(attention_k_eq_v=True, num_global_key_value_heads=global_kv_heads)
        if getattr(target, "attention_k_eq_v", False)
        else {}
    )
    text_config = Gemma4TextConfig(
        vocab_size=target.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=len(shape.layer_types),
        num_attention_heads=shape.num_attention_heads or target.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        sliding_window=target.sliding_window,
        layer_types=list(shape.layer_types),
        num_kv_shared_layers=len(shape.layer_types),
        rope_parameters=target.rope_parameters,
        rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings,
        initializer_range=shape.initializer_range,
        **k_eq_v,
    )
    if centroids and target.vocab_size % shape.num_centroids:
        raise ValueError(
            f"vocab {target.vocab_size} not divisible by {shape.num_centroids} centroids"
        )
    return Gemma4AssistantConfig(
        text_config=text_config,
        backbone_hidden_size=target.hidden_size,
        use_ordered_embeddings=centroids,
        num_centroids=shape.num_centroids,
        centroid_intermediate_top_k=shape.centroid_top_k,
    )


def _balanced_clusters(
    embed: torch.Tensor, num_clusters: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the vocab into equal-size clusters of similar embedding rows.

    Random clusters would make the centroid top-k miss a token's own cluster too often (a cluster
    mean of 32 random rows barely points at any one of them), so the copy assistant clusters by
    geometry: greedy balanced assignment to random directions, refined twice on the cluster means.
    Returns (token_ordering [vocab], unit centroids [num_clusters, dim]).
    """
    vocab, dim = embed.shape
    size = vocab // num_clusters
    rows = torch.nn.functional.normalize(embed, dim=-1)
    centres = torch.nn.functional.normalize(torch.randn(num_clusters, dim, generator=gen), dim=-1)
    members: list[torch.Tensor] = []
    for _ in range(3):
        assignment = balanced_assign(rows @ centres.T, size)
        members = [torch.nonzero(assignment == c).flatten() for c in range(num_clusters)]
        centres = torch.nn.functional.normalize(
            torch.stack([rows[m].mean(0) for m in members]), dim=-1
        )
    ordering = torch.cat([m[torch.randperm(size, generator=gen)] for m in members]).long()
    return ordering, centres


def _make_copy(
    model: Gemma4AssistantForCausalLM,
    target_embed: torch.Tensor,
    gen: torch.Generator,
    centroids: bool,
) -> None:
    """Set weights so the assistant drafts its input token: draft(t, h) == t for most t.

    With E_t the target embedding and P a random projection, the assistant embedding (= tied
    lm_head) is E_a = E_t P and pre_projection maps the token half sqrt(H_t) E_t[t] to E_a[t] / rms,
    so after the (nearly identity) layers and the final norm, the logits E_a . E_a[t]-ish peak at t.
    """
    target_hidden = target_embed.shape[1]
    inner = model.model
    hidden = inner.embed_tokens.weight.shape[1]
    with torch.no_grad():
        proj = torch.randn(target_hidden, hidden, generator=gen)
        embed = target_embed @ proj
        factor = _COPY_EMBED_RMS / embed.pow(2).mean().sqrt()
        embed, proj = embed * factor, proj * factor
        inner.embed_tokens.weight.copy_(embed)  # lm_head is tied to it

        # Token half: sqrt(H_t) E_t[t] -> E_a[t] / _COPY_EMBED_RMS (unit RMS). Hidden half: the
        # target's final-normed hidden (unit RMS) -> RMS _COPY_HIDDEN_MIX.
        token_half = proj.T / (math.sqrt(target_hidden) * _COPY_EMBED_RMS)
        hidden_half = torch.randn(hidden, target_hidden, generator=gen)
        hidden_half *= _COPY_HIDDEN_MIX / math.sqrt(target_hidden)
        model.pre_projection.weight.copy_(torch.cat([token_half, hidden_half], dim=1))

        for layer in inner.layers:
            layer.post_attention_layernorm.weight.fill_(_COPY_LAYER_GAIN)
            layer.post_feedforward_layernorm.weight.fill_(_COPY_LAYER_GAIN)

        if centroids:
            masked = model.masked_embedding
            assert masked is not None
            ordering, centres = _balanced_clusters(embed, masked.num_centroids, gen)
            masked.token_ordering.copy_(ordering)
            masked.centroids.weight.copy_(centres * _COPY_EMBED_RMS * math.sqrt(hidden))


def build_tiny_assistant(
    path: str | Path,
    target_path: str | Path,
    *,
    centroids: bool = True,
    style: AssistantStyle = "copy",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shape: AssistantShape = AssistantShape(),
) -> Path:
    """Write a tiny ``gemma4_assistant`` (Gemma4AssistantForCausalLM) matching the target.

    By default 2 fully KV-shared layers [sliding, full], hidden 64 (``shape`` sets other sizes);
    with ``centroids`` the lm_head goes through 64 centroids with top-8
    (``use_ordered_embeddings``) and a real ``token_ordering`` permutation (transformers would
    leave it all zeros). ``style="copy"`` drafts the input token again (see ``_make_copy``),
    ``style="random"`` is plain random weights.
    """
    target_dir = Path(target_path)
    target = _target_text_config(target_dir)
    config = assistant_config_for(target, centroids, shape)
    model = _construct(Gemma4AssistantForCausalLM, config)
    gen = _generator(seed, _ASSISTANT_SALT)
    _fill_random(model, gen, INIT_STD)
    if style == "copy":
        target_embed = _target_embed(target_dir)
        _make_copy(model, target_embed, gen, centroids)
    elif style != "random":
        raise ValueError(f"unknown assistant style {style!r}")
    if centroids and style == "random":
        assert model.masked_embedding is not None
        perm = torch.randperm(config.get_text_config().vocab_size, generator=gen)
        model.masked_embedding.token_ordering.copy_(perm)
    return _save(model, Path(path), dtype)


def build_tiny_pair(
    root: str | Path,
    *,
    centroids: bool = True,
    style: AssistantStyle = "copy",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **target_kwargs: Any,
) -> tuple[Path, Path]:
    """Write ``root/target`` and a matching ``root/assistant``; returns both paths."""
    root = Path(root)
    target = build_tiny_target(root / "target", seed=seed, dtype=dtype, **target_kwargs)
    assistant = build_tiny_assistant(
        root / "assistant", target, centroids=centroids, style=style, seed=seed, dtype=dtype
    )
    return target, assistant


@dataclass
class HFDraftStep:
    """Inputs and outputs of transformers' first assistant call after the target's prefill."""

    inputs_embeds: torch.Tensor  # [1, 1, 2*backbone]: cat(scaled target embed of t, target hidden)
    shared_kv_states: dict[str, tuple[torch.Tensor, torch.Tensor]]  # type -> (K, V) [1,kv,L,d]
    position_ids: torch.Tensor  # [1, 1] == [[len(prompt)]]
    logits: torch.Tensor  # [1, 1, vocab]
    projected_hidden: torch.Tensor  # [1, 1, backbone]: post_projection output (next step's input)
    token_id: int  # t, the target's greedy next token (the assistant's input token)
    target_hidden: torch.Tensor  # [1, 1, backbone]: target's final-normed hidden at position L-1


def load_hf_pair(
    target_path: str | Path, assistant_path: str | Path
) -> tuple[Gemma4ForCausalLM, Gemma4AssistantForCausalLM]:
    """A target and its assistant as transformers runs them, in float32 with eager attention
    (the reference the engine tests and benchmarks compare against), in eval mode."""
    target = Gemma4ForCausalLM.from_pretrained(
        target_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(
        assistant_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return target, assistant


def hf_draft_step(
    target_path: str | Path, assistant_path: str | Path, prompt_ids: list[int]
) -> HFDraftStep:
    """Reference for one draft step, run exactly as transformers' assisted generation does it.

    Mirrors ``SinglePositionMultiTokenCandidateGenerator.get_candidates`` right after the target's
    prefill of the L prompt tokens (float32, eager attention):

    * t = the target's greedy token after the prompt (it will sit at position L);
    * h = the target's final-normed hidden state at position L-1 (``hidden_states[-1]``, which is
      what the lm_head consumes and what vLLM's Gemma 4 model returns);
    * inputs_embeds = cat(embed_tokens(t) * sqrt(H_target), h);
    * shared_kv_states = per layer type, K/V (all L positions) of the target's last non-KV-shared
      layer of that type (as ``return_shared_kv_states=True`` gives them);
    * position_ids = L (``input_ids.shape[1] - 1`` once t is appended), i.e. t's position, NOT the
      last prompt token's; attention_mask = ones over the L + 1 ids, as ``generate`` passes it.
    """
    target, assistant = load_hf_pair(target_path, assistant_path)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    length = ids.shape[1]
    with torch.no_grad():
        out = target(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            use_cache=False,
            output_hidden_states=True,
            return_shared_kv_states=True,
        )
        token = out.logits[:, -1:].argmax(-1)  # [1, 1]
        hidden = out.hidden_states[-1][:, -1:]  # final-normed, [1, 1, H]
        shared = {name: (k, v) for name, (k, v) in out.shared_kv_states.items()}
        embeds = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
        position_ids = torch.tensor([[length]], dtype=torch.long)
        draft = assistant(
            inputs_embeds=embeds,
            attention_mask=torch.ones(1, length + 1, dtype=torch.long),
            position_ids=position_ids,
            shared_kv_states=shared,
            use_cache=False,
        )
    return HFDraftStep(
        inputs_embeds=embeds,
        shared_kv_states=shared,
        position_ids=position_ids,
        logits=draft.logits,
        projected_hidden=draft.last_hidden_state,
        token_id=int(token.item()),
        target_hidden=hidden,
    )


def reference_model(target_path: str | Path, dtype: torch.dtype) -> Any:
    """The target as transformers runs it, the reference of plain decoding: the checkpoint's own
    architecture in ``dtype``, eager attention and experts (transformers' grouped-matmul experts
    take no float64, which the near-tie judge runs MoE targets in), in evaluation mode."""
    return AutoModelForCausalLM.from_pretrained(
        str(target_path), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_greedy_tokens(
    target_path: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Reference for plain decoding: transformers' greedy continuation of each prompt (float32,
    eager attention, no end-of-sequence stop), through the checkpoint's own architecture."""
    model = reference_model(target_path, torch.float32)
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        tokens.append(out[0, ids.shape[1] :].tolist())
    return tokens
