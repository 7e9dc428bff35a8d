"""Drafting on Model Runner V2: every draft step a one-query step, all of them one CUDA graph.

vLLM's ``Gemma4Speculator`` (0.26) drafts in two parts. A "prefill" runs the assistant over
every token the target just verified, with the target's attention metadata, and samples at
each request's last accepted token; then ``k - 1`` one-query steps follow, each replayed from
a graph of its own, with host work between the parts (input preparation kernels, slot
mappings, the draft attention metadata). For the Gemma 4 assistant the first part is one-query
work too: it writes no K/V, so of the prefill's rows only each request's last accepted one is
ever used. Here each request's first draft step starts from that row alone: one launch stages
its token, position, target hidden state and key count (``ops/draft_inputs.py``), and the
``k`` steps run as one-query steps, replayed as one graph per batch size. The graphs are
captured at engine start-up for the sizes vLLM captures its draft decode graphs at, through
vLLM's own graph manager; larger batches, and engines without full graphs, run the same loop
eagerly.

The keys of a request end at its last accepted token in every step. vLLM 0.26 keeps the
target's sequence length for the later steps, so after a rejection they also attend to the
K/V the target wrote for the rejected tokens: the output is still the target's (it verifies),
but the drafts, and so acceptance, suffer. Our V1 proposer bounds the keys the same way.

Kept from vLLM: the model, its loading and KV sharing, the sampling of each draft token
(``sample_draft``: our ``get_top_tokens`` for greedy drafts, vLLM's Gumbel sampling for
probabilistic ones) and the request inputs it reads. vLLM's ``propose`` still runs where this
loop does not apply: data parallelism (its graph sizes are synchronised across ranks),
multimodal draft inputs and auxiliary hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.utils import record_function_or_nullcontext as scope
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.spec_decode.gemma4.speculator import Gemma4Speculator

from gemma4_spec.ops.draft_inputs import DraftStepBuffers, RunnerV2Step, stage_runner_v2_inputs
from gemma4_spec.ops.small_linear import use_target_rows_linear
from gemma4_spec.patch.patch_split_attention import draft_layers, mark_draft, route_draft


class Gemma4LoopSpeculator(Gemma4Speculator):
    """vLLM's Gemma 4 speculator for Model Runner V2, drafting through one-query steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_loop_state()

    def _init_loop_state(self) -> None:
        # The draft loop's inputs: vLLM's own buffers, which its graph manager captures with.
        self._staged = DraftStepBuffers(
            input_ids=self.input_buffers.input_ids,
            positions=self.input_buffers.positions,
            hidden=self.hidden_states,
            seq_lens=self.input_buffers.seq_lens,
            tables=(),
        )
        self.loop_replays = 0  # proposals replayed from a draft-loop graph
        self.loop_eager = 0  # proposals run eagerly through the same loop
        # Where the draft's attention goes to our split kernel (patch_split_attention): its
        # mode ("all", "sliding" or "auto"), None on vLLM's; set up before the first capture
        # or eager run.
        self._own_attention: str | None = None
        self._own_attention_set_up = False

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        use_target_rows_linear(target_model, self.device)  # opt-in

    def _draft_attention(self) -> None:
        if not self._own_attention_set_up:
            self._own_attention = route_draft(self.device)
            self._own_attention_set_up = True

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """vLLM's graph managers, without the speculation-length schedule
        (``num_speculative_tokens_per_batch_size``) where this loop drafts: its graphs are
        one-query steps whatever k the scheduler picks for a batch (a replay drafts the engine's
        k, the scheduler keeps the ones it scheduled), so no graph per k is needed. vLLM 0.26
        derives a one-query manager's per-k query lengths as ``k' + 1 - k`` and divides by zero
        at start-up for any ``k' < k`` (0.32 leaves one-query managers out of the schedule)."""
        spec = self.vllm_config.speculative_config
        if self._vllms_propose() or spec.num_speculative_tokens_per_batch_size is None:
            super().init_cudagraph_manager(cudagraph_mode)
            return
        schedule = spec.num_speculative_tokens_per_batch_size
        spec.num_speculative_tokens_per_batch_size = None
        try:
            super().init_cudagraph_manager(cudagraph_mode)
        finally:
            spec.num_speculative_tokens_per_batch_size = schedule

    def capture(self) -> None:
        """One graph of the whole draft loop per one-query batch size vLLM captures (its
        draft-prefill graphs are not needed: nothing drafts from them). Where vLLM's
        ``propose`` drafts instead, its own graphs."""
        if self._vllms_propose():
            super().capture()
            return
        manager = self.decode_cudagraph_manager
        if manager is None or not manager.needs_capture():
            return
        self._draft_attention()  # outside the capture: our kernel's counters
        manager.capture(
            self._draft_loop,
            self.model_state,
            self.input_buffers,
            self.block_tables,
            self.attn_groups,
            self.kv_cache_config,
            progress_bar_desc="Capturing draft-loop CUDA graphs",
        )

    @torch.inference_mode()
    def propose(
        self,
        input_batch: Any,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        num_tokens_across_dp: torch.Tensor | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
    ) -> torch.Tensor:
        if self._vllms_propose() or aux_hidden_states:
            return super().propose(
                input_batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill_tokens,
                temperature,
                seeds,
                num_tokens_across_dp=num_tokens_across_dp,
                dummy_run=dummy_run,
                skip_attn_for_dummy_run=skip_attn_for_dummy_run,
                mm_inputs=mm_inputs,
                is_profile=is_profile,
            )
        # A profiler scope (under VLLM_CUSTOM_SCOPES_FOR_PROFILING): the draft loop's GPU span,
        # apart from the target's forward and the verification (benchmarks/profile_decode.py).
        with scope("gemma4_spec: V2 draft loop"):
            num_reqs = input_batch.num_reqs
            if self.draft_logits is not None:  # what Gumbel sampling of the drafts reads
                self._copy_request_inputs(num_reqs, input_batch.idx_mapping, temperature, seeds)
            desc = self._dispatch(num_reqs, need_eager=is_profile)
            full = desc.cg_mode == CUDAGraphMode.FULL
            size = desc.num_tokens if full else num_reqs
            step = RunnerV2Step(
                query_start_loc=input_batch.query_start_loc,
                seq_lens=input_batch.seq_lens,
                positions=input_batch.positions,
                hidden=last_hidden_states,
                idx_mapping=input_batch.idx_mapping,
                num_sampled=num_sampled,
                rejected=num_rejected,
                last_sampled=last_sampled,
                next_prefill_tokens=next_prefill_tokens,
            )
            stage_runner_v2_inputs(
                step, self._staged, self.input_buffers.query_start_loc, num_reqs, size
            )
            self._prepare_eplb_forward(num_reqs)
            if full:
                assert self.decode_cudagraph_manager is not None
                self.decode_cudagraph_manager.run_fullgraph(desc)
                self.loop_replays += 1
            else:
                attn = None
                self._draft_attention()
                if not (dummy_run and skip_attn_for_dummy_run):
                    longest = int(input_batch.seq_lens_cpu_upper_bound[:num_reqs].max())
                    self.draft_max_seq_len = min(longest, self.max_model_len)
                    attn = self._build_draft_attn_metadata(
                        num_reqs=num_reqs, num_reqs_padded=num_reqs, num_tokens_padded=num_reqs
                    )
                self._draft_loop(num_reqs, num_reqs, attn, None, None)
                self.loop_eager += 1
            return self.draft_tokens[:num_reqs]

    def _vllms_propose(self) -> bool:
        """Engines vLLM's ``propose`` drafts for: data parallelism (its graph sizes are
        synchronised across ranks) and multimodal draft inputs."""
        return self.dp_size > 1 or bool(self.supports_mm_inputs)

    def _dispatch(self, num_reqs: int, need_eager: bool) -> BatchExecutionDescriptor:
        manager = self.decode_cudagraph_manager
        if need_eager or manager is None:
            return BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE, num_tokens=num_reqs, num_reqs=num_reqs
            )
        return manager.dispatch(num_reqs, num_reqs, 1, 0)

    def _draft_loop(
        self,
        num_reqs: int,
        num_tokens: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        """All ``k`` draft steps over the staged rows (``num_tokens`` of them, padding
        included): what a draft-loop graph replays. The assistant writes no K/V, so the slot
        mappings are not needed; the keys and positions stay those of the staged rows."""
        del num_reqs  # every staged row is drafted; padding rows have no keys
        n = num_tokens
        layers = draft_layers(self._own_attention, n)
        if layers is not None and attn_metadata is not None:
            for metadata in attn_metadata.values():
                mark_draft(metadata, layers)
        positions = self.input_buffers.positions[:n]
        idx_mapping = self.idx_mapping[:n]
        steps = self.num_speculative_steps
        for step in range(steps):
            if self.draft_logits is not None:
                self.current_draft_step.fill_(step)
            out, next_hidden = self._run_model(
                n, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode
            )
            tokens = self.sample_draft(
                out[:n],
                positions,
                idx_mapping,
                self.temperature,
                self.seeds,
                self.current_draft_step,
                self.draft_logits,
            )
            self.draft_tokens[:n, step] = tokens
            if step + 1 < steps:
                self.input_buffers.input_ids[:n] = tokens
                self.hidden_states[:n] = next_hidden[:n]
