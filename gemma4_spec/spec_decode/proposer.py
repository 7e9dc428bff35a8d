"""``Gemma4Proposer``: drafts with a Gemma 4 assistant inside vLLM's V1 model runner.

What differs from vLLM's generic draft-model flow (``SpecDecodeBaseProposer``):

* The assistant reads the target's K/V and writes none, so every draft step of a request uses
  the same position and the same attention metadata.
* Gemma 4 keeps sliding-window and full-attention layers in different KV cache groups (with
  different head sizes and block tables). Each draft layer belongs to the group of the target
  layer it reads, so metadata is built per group, each with its own block table.
* The draft's input embedding is the target's (backbone width); the checkpoint's draft-width
  embedding is used only as the draft's own lm_head. Whatever the base class decides about
  sharing, we attach the target's embedding ourselves (vLLM 0.26's base class keeps the draft's
  embedding when the widths differ: vllm#47794).
* With a quantized KV cache, each draft layer reads the target's cache with that target layer's
  K/V scales (``kv_scales.py``).
* Probabilistic drafting (vLLM's) drafts seeded requests greedily, with a one-hot
  probability, so that they repeat (``seeded_drafts.py``).
* Greedy drafting goes through the model's ``get_top_tokens`` (centroid-masked argmax without a
  full-vocabulary tensor when the assistant uses centroids).
* ``propose`` runs every draft step on one query per request. The base class first runs the
  draft over every token the target just processed (the whole prompt after a prefill, all k + 1
  verified tokens after a decode step) to fill a draft KV cache; the assistant has none, so only
  the last accepted token of each request matters. Every step is then the same shape: B tokens.
* After verification, the runner's two questions to the drafter (each request's next token and
  kept count; the row its drafting starts from) are answered by ``draft_start.py`` from graphed
  launches rather than by the base class's Python-launched kernels.
"""

from __future__ import annotations

import dataclasses
from copy import copy
from typing import Any

import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config, replace
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.platforms import current_platform
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, UniformTypeKVCacheSpecs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.utils import record_function_or_nullcontext as scope
from vllm.v1.worker.utils import AttentionGroup

from gemma4_spec.compat import build_drafting_metadata
from gemma4_spec.log import get_logger
from gemma4_spec.ops.small_linear import use_target_rows_linear
from gemma4_spec.patch.patch_rejection_sampler import (
    GREEDY_VERIFY_ATTR,
    GreedyVerifyStats,
    greedy_verify_enabled,
)
from gemma4_spec.spec_decode.computed_tokens import register_runner
from gemma4_spec.spec_decode.draft_graphs import DraftLoopGraphs, loop_graph_size
from gemma4_spec.spec_decode.draft_start import DRAFT_START_ENV, DraftStart
from gemma4_spec.spec_decode.kv_scales import share_kv_scales
from gemma4_spec.spec_decode.sampler_graphs import GraphedGreedySampler
from gemma4_spec.spec_decode.seeded_drafts import one_hot_drafts
from gemma4_spec.spec_decode.verify_input_ids import VERIFY_INPUT_IDS_ENV, VerifyInputIds
from gemma4_spec.spec_decode.verify_metadata import VERIFY_METADATA_ENV, VerifyMetadataBuilder
from gemma4_spec.switches import turned_off

logger = get_logger(__name__)
# Set to 0 to sample drafts eagerly (no CUDA graph of the sampling).
SAMPLER_GRAPHS_ENV = "GEMMA4_SPEC_SAMPLER_GRAPHS"


class Gemma4Proposer(SpecDecodeBaseProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config, device, pass_hidden_states_to_model=True, runner=runner)
        self._runner = runner
        # KV cache group id -> that group's block table for the current step (set by the runner).
        self._block_tables: dict[int, torch.Tensor] = {}
        # Greedy sampling from CUDA graphs, captured with the runner's drafter graphs.
        self.sampler: GraphedGreedySampler | None = None
        # Whole greedy draft loops from CUDA graphs (captured with the runner's graphs).
        self.loop_graphs: DraftLoopGraphs | None = None
        # Proposals whose drafts were sampled from the assistant's distribution (their
        # probabilities handed to the rejection sampler), not taken greedily.
        self.probabilistic_proposals = 0
        # The runner's verification index arrays, built in one transfer (the runner asks it
        # through patch/patch_gpu_model_runner.py; None: vLLM builds them).
        self.verify_metadata = (
            None if turned_off(VERIFY_METADATA_ENV) else VerifyMetadataBuilder(device)
        )
        # Async scheduling's carried tokens into the verification step's input ids, in one
        # transfer (asked the same way; None: vLLM writes them).
        self.verify_input_ids = None if turned_off(VERIFY_INPUT_IDS_ENV) else VerifyInputIds(device)
        # Each request's next token and first draft row after verification, from graphed
        # launches (None: the base class's methods).
        self.draft_start = (
            None if turned_off(DRAFT_START_ENV) else DraftStart(self.max_batch_size, device)
        )
        # Batch size -> (graph mode, padded size, None), once vLLM's graph sizes are settled.
        self._padding: dict[int, tuple[CUDAGraphMode, int, None]] = {}

    # The runner hands over each KV cache group's block table before proposing.
    def set_per_group_block_table(self, gid: int, block_table: torch.Tensor) -> None:
        self._block_tables[gid] = block_table

    def block_table_of(self, gid: int, metadata: CommonAttentionMetadata) -> torch.Tensor:
        """KV cache group ``gid``'s block table this step (the runner's; rows may run past the
        batch). The group the runner built ``metadata`` for may have none of its own."""
        return self._block_tables.get(gid, metadata.block_table_tensor)

    def _determine_batch_execution_and_padding(
        self, num_tokens: int, use_cudagraphs: bool = True
    ) -> tuple[CUDAGraphMode, int, torch.Tensor | None]:
        """The base class's answer, remembered per batch size where it can only repeat
        itself: one data-parallel rank, graphs allowed, and the dispatcher's graph sizes
        settled (they are once the runner has captured)."""
        base = SpecDecodeBaseProposer._determine_batch_execution_and_padding
        if (
            not use_cudagraphs
            or self.vllm_config.parallel_config.data_parallel_size > 1
            or not getattr(self.cudagraph_dispatcher, "keys_initialized", False)
        ):
            return base(self, num_tokens, use_cudagraphs)
        hit = self._padding.get(num_tokens)
        if hit is None:
            mode, padded, across_dp = base(self, num_tokens, use_cudagraphs)
            if across_dp is not None:  # not expected with one rank: do not remember it
                return mode, padded, across_dp
            hit = self._padding[num_tokens] = (mode, padded, None)
        return hit

    def prepare_next_token_ids_padded(
        self,
        sampled_token_ids: torch.Tensor,
        requests: dict[str, Any],
        gpu_input_batch: Any,
        discard_request_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.draft_start is None:
            return super().prepare_next_token_ids_padded(
                sampled_token_ids, requests, gpu_input_batch, discard_request_mask
            )
        return self.draft_start.next_tokens(
            sampled_token_ids,
            requests,
            gpu_input_batch,
            discard_request_mask,
            self.backup_next_token_ids,
        )

    def prepare_inputs_padded(
        self,
        common_attn_metadata: CommonAttentionMetadata,
        spec_decode_metadata: Any,
        valid_sampled_tokens_count: torch.Tensor,
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        if self.draft_start is None:
            return super().prepare_inputs_padded(
                common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count
            )
        return self.draft_start.rows(
            common_attn_metadata,
            spec_decode_metadata.cu_num_draft_tokens,
            valid_sampled_tokens_count,
        )

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.sampler is not None:
            return self.sampler(hidden_states)
        return self.model.get_top_tokens(hidden_states)

    def _sample_draft_tokens(
        self, hidden_states: torch.Tensor, sampling_metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vLLM's draft sampling (greedy, or probabilistic when configured), except that seeded
        requests draft greedily with a one-hot probability (``seeded_drafts.py``): vLLM draws
        probabilistic drafts from the global generator, which would keep a seed from
        repeating."""
        tokens, probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
        rows = sorted(i for i in sampling_metadata.generators if i < hidden_states.shape[0])
        if probs is None or not rows:
            return tokens, probs
        greedy = self.model.get_top_tokens(hidden_states[rows])
        return one_hot_drafts(tokens, probs, rows, greedy)

    def _capture_sampler(self, num_tokens: int) -> None:
        if self.device.type != "cuda" or turned_off(SAMPLER_GRAPHS_ENV):
            return
        if self.sampler is None:
            head = self.model.lm_head.weight
            self.sampler = GraphedGreedySampler(
                self.model.get_top_tokens, head.shape[1], head.dtype, self.device
            )
        self.sampler.capture(num_tokens, pool=current_platform.get_global_graph_pool())
        logger.debug("gemma4_spec: captured greedy draft sampling for %d tokens", num_tokens)

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs: object = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: object = None,
    ) -> torch.Tensor:
        """Draft ``num_speculative_tokens`` tokens per request: ``[B, k]``.

        Step 1 feeds (the target's new token, its hidden state at the last accepted position
        p); each further step feeds the previous draft token and the assistant's own projected
        hidden state. All steps query at position p over the target's cache up to p."""
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        if num_speculative_tokens == 0:
            return torch.empty(batch_size, 0, dtype=torch.int64, device=self.device)
        if token_indices_to_sample is None:
            token_indices_to_sample = common_attn_metadata.query_start_loc[1:] - 1
        if target_positions.dim() == 2:  # M-RoPE target: text positions are all rows alike
            target_positions = target_positions[0]

        # Scopes show in torch.profiler with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 (no-ops otherwise).
        with scope("gemma4_spec: draft inputs"):
            mode, num_input_tokens, tokens_across_dp = self._determine_batch_execution_and_padding(
                batch_size
            )
        greedy = not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy
        if greedy and self.loop_graphs is None:
            self.loop_graphs = DraftLoopGraphs(self)
        # A whole-loop graph only where the runner has drafter graphs for this size.
        if greedy and mode != CUDAGraphMode.NONE and tokens_across_dp is None:
            assert self.loop_graphs is not None
            drafted = self.loop_graphs.draft(
                batch_size,
                loop_graph_size(batch_size, num_input_tokens),
                num_speculative_tokens,
                common_attn_metadata,
                next_token_ids,
                target_positions,
                target_hidden_states,
                token_indices_to_sample,
                num_rejected_tokens_gpu,
            )
            if drafted is not None:
                return drafted

        with scope("gemma4_spec: draft inputs"):
            self.input_ids[:batch_size] = next_token_ids
            self.positions[:batch_size] = target_positions[token_indices_to_sample]
            self.hidden_states[:batch_size] = target_hidden_states[token_indices_to_sample]
            metadata = self._one_query_per_request(
                common_attn_metadata, token_indices_to_sample, num_rejected_tokens_gpu
            )
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(metadata)

        draft_tokens: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor] = []
        slot_mapping = self._get_slot_mapping(num_input_tokens, metadata.slot_mapping)
        for step in range(num_speculative_tokens):
            draft_hidden, next_hidden = self._draft_step(
                per_layer_metadata, num_input_tokens, tokens_across_dp, mode, slot_mapping
            )
            tokens, probs = self._sample_draft_tokens(draft_hidden[:batch_size], sampling_metadata)
            draft_tokens.append(tokens)
            if probs is not None:
                draft_probs.append(probs)
            if step + 1 < num_speculative_tokens:
                self.input_ids[:batch_size] = tokens
                self.hidden_states[:batch_size] = next_hidden[:batch_size]

        if draft_probs:
            self._last_draft_probs = torch.stack(draft_probs, dim=1).contiguous()
            self.probabilistic_proposals += 1
        return torch.stack(draft_tokens, dim=1)

    def _one_query_per_request(
        self,
        metadata: CommonAttentionMetadata,
        token_indices: torch.Tensor,
        num_rejected_tokens: torch.Tensor | None,
    ) -> CommonAttentionMetadata:
        """The target step's metadata reduced to one query token per request, at its last
        accepted position: the request's keys end there (rejected tokens' K/V, still in the
        cache, are cut off from ``seq_lens``)."""
        batch_size = metadata.batch_size()
        seq_lens = metadata.seq_lens
        if num_rejected_tokens is not None:
            seq_lens = seq_lens - num_rejected_tokens
        return dataclasses.replace(
            metadata,
            query_start_loc=self.arange[: batch_size + 1],
            query_start_loc_cpu=torch.from_numpy(self.token_arange_np[: batch_size + 1]).clone(),
            seq_lens=seq_lens,
            num_actual_tokens=batch_size,
            max_query_len=1,
            slot_mapping=metadata.slot_mapping[token_indices],
            positions=None if metadata.positions is None else self.positions[:batch_size],
        )

    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Mirror ``propose`` (one batch-shape decision, then the draft steps) so idle
        data-parallel ranks make the same collective calls as busy ones."""
        mode, num_input_tokens, tokens_across_dp = self._determine_batch_execution_and_padding(
            num_tokens, use_cudagraphs=use_cudagraphs
        )
        steps = 1 if is_graph_capturing else self.num_speculative_tokens
        slot_mapping = self._get_slot_mapping(num_input_tokens)
        for _ in range(steps):
            self._draft_step(None, num_input_tokens, tokens_across_dp, mode, slot_mapping)
        if is_graph_capturing and mode != CUDAGraphMode.NONE:
            self._capture_sampler(num_input_tokens)
            self._capture_draft_loops()

    def _capture_draft_loops(self) -> None:
        """Capture the whole greedy draft loop for every batch size the runner drafts through
        graphs, once, while vLLM captures its own graphs: no request waits for a capture."""
        if self.loop_graphs is None:
            self.loop_graphs = DraftLoopGraphs(self)
        graphs = self.loop_graphs
        if graphs.captured_at_startup or graphs.disabled is not None:
            return  # dummy_run comes once per vLLM capture size
        sizes: set[int] = set()
        for batch_size in range(1, self.max_batch_size + 1):
            mode, padded, across_dp = self._determine_batch_execution_and_padding(batch_size)
            if mode != CUDAGraphMode.NONE and across_dp is None:
                sizes.add(loop_graph_size(batch_size, padded))
        block_tables = self._runner.input_batch.block_table
        tables = tuple(
            block_tables[gid].get_device_tensor(self.max_batch_size) for gid in graphs.group_ids()
        )
        graphs.capture_at_startup(sorted(sizes), self.num_speculative_tokens, tables)

    def _draft_step(
        self,
        per_layer_metadata: dict[str, object] | None,
        num_input_tokens: int,
        tokens_across_dp: torch.Tensor | None,
        mode: CUDAGraphMode,
        slot_mapping: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One assistant forward over the first ``num_input_tokens`` rows of the input buffers:
        (draft-width hidden for the logits, backbone-width hidden for the next step)."""
        with set_forward_context(
            per_layer_metadata,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=tokens_across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=slot_mapping,
        ):
            return self.model(
                input_ids=self.input_ids[:num_input_tokens],
                positions=self.positions[:num_input_tokens],
                hidden_states=self.hidden_states[:num_input_tokens],
            )

    def build_per_group_and_layer_attn_metadata(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        batch_size = common_attn_metadata.batch_size()
        # The runner's tables may be padded past the drafted batch.
        tables = {
            group.kv_cache_group_id: self.block_table_of(
                group.kv_cache_group_id, common_attn_metadata
            )[:batch_size]
            for group in self.draft_attn_groups
        }
        return self.metadata_over_tables(common_attn_metadata, tables, draft_index)

    def metadata_over_tables(
        self,
        common_attn_metadata: CommonAttentionMetadata,
        tables: dict[int, torch.Tensor],
        draft_index: int = 0,
    ) -> tuple[list[object], dict[str, object]]:
        """Each draft attention group's metadata (and the same per layer), built from
        ``common_attn_metadata`` with the group's block table from ``tables`` (by KV cache
        group id)."""
        per_group: list[object] = []
        per_layer: dict[str, object] = {}
        for group in self.draft_attn_groups:
            metadata = copy(common_attn_metadata)
            metadata.block_table_tensor = tables[group.kv_cache_group_id]
            built = build_drafting_metadata(group, metadata, draft_index)
            per_group.append(built)
            per_layer.update(dict.fromkeys(group.layer_names, built))
        return per_group, per_layer

    def _create_draft_vllm_config(self) -> VllmConfig:
        # The base class lets the draft pick its own attention backend. Ours reads caches that
        # the target's backend laid out, so it must use the same one.
        draft = super()._create_draft_vllm_config()
        return replace(
            draft,
            attention_config=replace(
                draft.attention_config, backend=self.vllm_config.attention_config.backend
            ),
        )

    def _maybe_share_embeddings(self, target_language_model: nn.Module) -> None:
        if get_pp_group().world_size != 1:
            raise NotImplementedError(
                "gemma4_mtp drafting with pipeline parallelism is not supported: the assistant "
                "needs the target's input embedding on the last stage. Use tensor parallelism."
            )
        embed = getattr(getattr(target_language_model, "model", None), "embed_tokens", None)
        if embed is None:
            raise AttributeError(
                f"{type(target_language_model).__name__} has no model.embed_tokens: the target "
                "is not a Gemma 4 language model as vLLM builds it."
            )
        self.model.model.embed_tokens = embed
        logger.info("gemma4_spec: the assistant embeds its input with the target's embedding.")

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        share_kv_scales(self._draft_attn_layer_names, layers)
        use_target_rows_linear(target_model, self.device)  # opt-in
        register_runner(self._runner)  # async scheduling's count correction, graphed
        # The runner's rejection sampler exists by now: let it verify greedy batches itself.
        sampler = getattr(self._runner, "rejection_sampler", None)
        if sampler is not None and greedy_verify_enabled():
            setattr(sampler, GREEDY_VERIFY_ATTR, GreedyVerifyStats())

    def _maybe_share_lm_head(self, target_language_model: nn.Module) -> None:
        """The assistant keeps its own draft-width lm_head (the target's is backbone-width)."""

    def validate_same_kv_cache_group(self, kv_cache_config: KVCacheConfig) -> None:
        """Draft layers span the sliding and full-attention groups by design."""

    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        """One attention group per (backend, KV spec) among the draft layers, each tied to the
        KV cache group of the target layers whose cache it reads."""
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        group_of: dict[str, int] = {}
        spec_of: dict[str, KVCacheSpec] = {}
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                group_of[name] = gid
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    source = layers[name].kv_sharing_target_layer_name or name
                    spec = spec.kv_cache_specs[source]
                spec_of[name] = spec

        groups: dict[tuple[str, KVCacheSpec], AttentionGroup] = {}
        for name in sorted(self._draft_attn_layer_names):
            backend = layers[name].get_attn_backend()
            key = (backend.full_cls_name(), spec_of[name])
            if key in groups:
                groups[key].layer_names.append(name)
                continue
            gid = group_of[name]
            group = AttentionGroup(
                backend=backend,
                layer_names=[name],
                kv_cache_spec=spec_of[name],
                kv_cache_group_id=gid,
            )
            group.create_metadata_builders(
                self.vllm_config,
                self.device,
                kernel_block_size=None if kernel_block_sizes is None else kernel_block_sizes[gid],
            )
            groups[key] = group

        self.draft_attn_groups = list(groups.values())
        first = self.draft_attn_groups[0]
        # The runner passes this group's common metadata to propose(); the others get their
        # own block tables in build_per_group_and_layer_attn_metadata.
        self.kv_cache_gid = first.kv_cache_group_id
        self.block_size = first.kv_cache_spec.block_size
