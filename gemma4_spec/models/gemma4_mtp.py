"""The Gemma 4 assistant (``gemma4_assistant`` checkpoints) as a vLLM draft model.

One draft step, for each request's last accepted position ``p``:

    x = concat(target_embedding(token) * sqrt(backbone_hidden), target_hidden)   # 2 * backbone
    h = pre_projection(x)                                                         # draft width
    h = decoder layers(h)       # Q-only attention over the target's own K/V cache at <= p
    h = norm(h)
    draft logits   = lm_head(h)             (optionally centroid-masked)
    next hidden    = post_projection(h)     (backbone width, the next step's target_hidden)

Every draft step of a request uses the same position ``p``: the assistant never writes K/V, so
there is nothing at ``p + 1`` for it to attend to.

Checkpoint names are kept as they are in the HF checkpoint, so loading needs one declared rename
(the stacked MLP gate/up projections) and one alias (the lm_head is tied to
``model.embed_tokens``). The draft-width ``embed_tokens`` of the checkpoint is only the lm_head:
the input embedding is the target's, attached by the proposer after loading.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from gemma4_spec.ops.centroid_argmax import CentroidMask, masked_logits
from gemma4_spec.ops.centroid_argmax_triton import centroid_argmax_fused
from gemma4_spec.ops.q_norm_rope import fuses_q_rope
from gemma4_spec.ops.small_linear import fuses_gelu, use_small_rows_linear
from gemma4_spec.ops.vocab_argmax_triton import vocab_argmax
from gemma4_spec.validation import SLIDING_ATTENTION, kv_source_layers, layer_attention_shape

# (checkpoint name fragment, our parameter fragment, shard id) for stacked parameters.
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)
# The lm_head is tied to the draft-width embedding; either name may be in a checkpoint.
LM_HEAD_ALIASES: tuple[str, ...] = ("model.embed_tokens.weight", "lm_head.weight")


class QOnlyAttention(nn.Module):
    """Attention with a query projection only: K/V are read from a target layer's cache.

    vLLM's KV sharing (``kv_sharing_target_layer_name``) makes this layer read the cache of
    ``kv_source`` and never write one. Like the target's Gemma 4 layers, the softmax scale is
    1.0 (the learnt q/k norms carry the scale)."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        kv_source: str,
        cache_config: CacheConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        num_kv_heads, head_dim = layer_attention_shape(config, layer_idx)
        self.num_heads = config.num_attention_heads // tp_size
        self.head_dim = head_dim
        layer_type = config.layer_types[layer_idx]
        sliding_window = config.sliding_window if layer_type == SLIDING_ATTENTION else None

        self.q_proj = ColumnParallelLinear(
            config.hidden_size,
            config.num_attention_heads * head_dim,
            bias=config.attention_bias,
            prefix=f"{prefix}.q_proj",
        )
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters[layer_type]),
            is_neox_style=True,
        )
        self.attn = Attention(
            self.num_heads,
            head_dim,
            1.0,
            num_kv_heads=max(1, num_kv_heads // tp_size),
            cache_config=cache_config,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            per_layer_sliding_window=sliding_window,
            kv_sharing_target_layer_name=kv_source,
            prefix=f"{prefix}.attn",
        )
        # The query norm and rotary embedding as one op (q_norm_rope); set by the model for
        # its device (fuse_q_rope).
        self.fused_q_rope = False

    def fuse_q_rope(self, device: torch.device | str | None) -> None:
        self.fused_q_rope = fuses_q_rope(self.rotary_emb, device)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj(hidden_states)
        if self.fused_q_rope:
            q = torch.ops.gemma4_spec.q_norm_rope(
                q,
                self.q_norm.weight,
                self.rotary_emb.cos_sin_cache,
                positions,
                self.q_norm.variance_epsilon,
                self.head_dim,
            )
        else:
            q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))).flatten(-2)
            q, _ = self.rotary_emb(positions, q, None)
        out, _ = self.o_proj(self.attn(q, None, None))
        return out


class AssistantMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), with gate and up stacked in one matmul."""

    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = get_act_and_mul_fn(config.hidden_activation)
        self.activation = config.hidden_activation
        # Gate/up matmul and activation as one op (small_linear_gelu_and_mul); set by the
        # model once its layers have their linear methods (fuse_gelu).
        self.fused_gelu = False

    def fuse_gelu(self) -> None:
        self.fused_gelu = fuses_gelu(self.gate_up_proj, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gelu:
            hidden = torch.ops.gemma4_spec.small_linear_gelu_and_mul(x, self.gate_up_proj.weight)
        else:
            gate_up, _ = self.gate_up_proj(x)
            hidden = self.act_fn(gate_up)
        out, _ = self.down_proj(hidden)
        return out


class AssistantDecoderLayer(nn.Module):
    """Gemma 4 sandwich-norm block: each sub-layer's output is normed before the residual add,
    and the block output is scaled by the learnt ``layer_scalar``."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        kv_source: str,
        cache_config: CacheConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = QOnlyAttention(
            config, layer_idx, kv_source, cache_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = AssistantMLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_feedforward_layernorm(mlp)
        return hidden_states * self.layer_scalar


class AssistantBackbone(nn.Module):
    """The ``model.*`` part of the checkpoint: decoder layers and final norm.

    ``embed_tokens`` is the target's (backbone-width) embedding, attached by the proposer."""

    def __init__(
        self,
        config: PretrainedConfig,
        kv_sources: list[str],
        cache_config: CacheConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module | None = None
        self.layers = nn.ModuleList(
            AssistantDecoderLayer(
                config, idx, kv_sources[idx], cache_config, prefix=f"{prefix}.layers.{idx}"
            )
            for idx in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class CentroidMaskedHead(nn.Module):
    """Centroid scores and the vocabulary permutation that groups tokens by centroid."""

    token_ordering: torch.Tensor

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(vocab_size, dtype=torch.long))


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "inputs_embeds": 0}
)
class Gemma4AssistantForDrafting(nn.Module):
    """vLLM model class for ``gemma4_assistant`` checkpoints (architecture ``Gemma4MTPModel``).

    ``forward`` returns ``(draft_hidden, backbone_hidden)``: the first feeds the draft lm_head,
    the second is the next draft step's ``hidden_states`` input."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        spec_config = vllm_config.speculative_config
        assert spec_config is not None and spec_config.draft_model_config is not None
        draft_model_config = spec_config.draft_model_config
        config = draft_model_config.hf_config
        text_config = config.get_text_config()
        target_text_config = vllm_config.model_config.hf_config.get_text_config()
        self.config = config
        self.text_config = text_config
        self.vocab_size: int = text_config.vocab_size

        # The draft never takes the target's quantization: nothing below gets a quant_config.
        kv_sources = _target_attention_layer_names(
            vllm_config, kv_source_layers(target_text_config, text_config)
        )
        backbone_hidden = config.backbone_hidden_size
        # vLLM registers attention layers by prefix, and the target already owns "model.*":
        # the assistant's layers are registered as "assistant.*" (parameter names are unchanged).
        self.model = AssistantBackbone(
            text_config, kv_sources, vllm_config.cache_config, prefix=_join(prefix, "assistant")
        )
        self.pre_projection = ReplicatedLinear(
            2 * backbone_hidden,
            text_config.hidden_size,
            bias=False,
            prefix=_join(prefix, "pre_projection"),
        )
        self.post_projection = ReplicatedLinear(
            text_config.hidden_size,
            backbone_hidden,
            bias=False,
            prefix=_join(prefix, "post_projection"),
        )
        # Replicated on every rank: the centroid path gathers arbitrary rows of it.
        self.lm_head = nn.Linear(text_config.hidden_size, self.vocab_size, bias=False)
        self.masked_embedding: CentroidMaskedHead | None = None
        if getattr(config, "use_ordered_embeddings", False):
            self.masked_embedding = CentroidMaskedHead(
                text_config.hidden_size,
                self.vocab_size,
                config.num_centroids,
                config.centroid_intermediate_top_k,
            )
        self.final_logit_softcapping: float | None = getattr(
            text_config, "final_logit_softcapping", None
        )
        # The target scales its embeddings by sqrt(hidden) in the model dtype; so do we.
        self.register_buffer(
            "embed_scale",
            torch.tensor(backbone_hidden**0.5, dtype=vllm_config.model_config.dtype),
            persistent=False,
        )
        suppress = (draft_model_config.try_get_generation_config() or {}).get("suppress_tokens")
        self.register_buffer(
            "suppressed_tokens",
            torch.tensor(list(suppress or []), dtype=torch.long),
            persistent=False,
        )
        # The projections' matmuls, a few rows each draft step, in one launch each on CUDA.
        use_small_rows_linear(self, vllm_config.device_config.device)
        for module in self.modules():
            if isinstance(module, AssistantMLP):
                module.fuse_gelu()
            elif isinstance(module, QOnlyAttention):
                module.fuse_q_rope(vllm_config.device_config.device)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.model.embed_tokens is None:
            raise RuntimeError(
                "The Gemma 4 assistant has no input embedding yet: the proposer attaches the "
                "target's embedding after loading (Gemma4Proposer.load_model)."
            )
        return self.model.embed_tokens(input_ids) * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed_input_ids(input_ids)
        h, _ = self.pre_projection(torch.cat([inputs_embeds, hidden_states], dim=-1))
        for layer in self.model.layers:
            h = layer(positions, h)
        h = self.model.norm(h)
        backbone_hidden, _ = self.post_projection(h)
        return h, backbone_hidden

    def _centroid_mask(self) -> CentroidMask | None:
        if self.masked_embedding is None:
            return None
        return CentroidMask(
            self.masked_embedding.centroids.weight,
            self.masked_embedding.token_ordering,
            self.masked_embedding.top_k,
            self.suppressed_tokens,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocab draft logits; with centroid masking, unselected tokens are ``-inf``."""
        mask = self._centroid_mask()
        if mask is not None:
            return masked_logits(hidden_states, self.lm_head.weight, mask)
        logits = self.lm_head(hidden_states)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if self.suppressed_tokens.numel() > 0:
            logits[:, self.suppressed_tokens] = float("-inf")
        return logits

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens, ``compute_logits(...).argmax(-1)`` without a full-vocab tensor:
        the argmax over the top-k centroids' tokens, or, without centroids, over the whole
        vocabulary in one kernel; suppressed tokens are never drafted.

        Soft-capping is monotonic, so the argmax does not need it."""
        mask = self._centroid_mask()
        if mask is None:
            return vocab_argmax(hidden_states, self.lm_head.weight, self.suppressed_tokens)
        return centroid_argmax_fused(mask, hidden_states, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name in LM_HEAD_ALIASES:
                name = "lm_head.weight"
            if name == "lm_head.weight" and name in loaded:
                continue  # tied copy of a tensor already loaded under the other name
            for ckpt_part, our_part, shard in STACKED_PARAMS:
                if ckpt_part in name:
                    name = name.replace(ckpt_part, our_part)
                    params[name].weight_loader(params[name], tensor, shard)
                    break
            else:
                if name in params:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                elif name in buffers:
                    buffers[name].copy_(tensor.to(buffers[name].dtype))
                else:
                    raise ValueError(
                        f"Unexpected tensor {name!r} in the Gemma 4 assistant checkpoint: this "
                        "is not a gemma4_assistant checkpoint of a layout we know."
                    )
            loaded.add(name)
        return loaded


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _target_attention_layer_names(vllm_config: VllmConfig, layer_ids: list[int]) -> list[str]:
    """vLLM names of the target attention layers with the given indices.

    The target is built before the draft, so its layers are already registered; their prefix
    differs between text-only and multimodal Gemma 4 targets, so look them up by suffix."""
    registered = list(vllm_config.compilation_config.static_forward_context)
    names = []
    for idx in layer_ids:
        suffix = f"layers.{idx}.self_attn.attn"
        matches = [n for n in registered if n == suffix or n.endswith("." + suffix)]
        if len(matches) != 1:
            raise RuntimeError(
                f"Expected one target attention layer named '*{suffix}', found {matches}: is "
                "the target a Gemma 4 model loaded by vLLM?"
            )
        names.append(matches[0])
    return names
