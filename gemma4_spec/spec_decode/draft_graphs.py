"""The whole greedy draft loop of a batch, replayed from one CUDA graph.

vLLM's V1 runner gives a drafter piecewise graphs only (0.26): the attention of every draft
layer runs eagerly between graph pieces, with its Python launch cost. On the E2B-shaped
benchmark (H200, vLLM 0.26.0) that made a k=2 speculative step cost 2.5x a plain one, most of it
CPU time in eager draft attention (``benchmarks/results/h200``). Our draft steps all have the
same shape (one query per request; the same attention metadata in every step), so the k steps
and their greedy sampling are captured together, once per (padded batch size, k), and replayed
as one graph.

What a graph reads stays at fixed addresses: the proposer's step inputs (token ids, positions,
hidden states) and the buffers here: sequence lengths, one block table per KV cache group, and
the base class's slot-mapping buffer. Every call stages the batch into them in one launch
(``ops/draft_inputs.py``: the rows past the batch become requests of one key on the null
block) and replays. Where a draft attention backend may derive state from its metadata (into a
builder's persistent buffers), the metadata is also rebuilt over the buffers before every
replay, as vLLM's runner does before replaying its own full graphs; backends whose metadata
only refers to the tensors it is given (``compat.REBUILD_FREE_DRAFT_METADATA``) skip that host
work. The slot mapping is never restaged: draft layers read the target's K/V and write none.

Every (size, k) the runner can draft through graphs is captured at engine start-up, when vLLM
captures its own graphs (the proposer's ``dummy_run`` during the runner's capture), over dummy
requests of one key on the null block: a request never waits for a capture. A batch whose size
was not captured drafts step by step. Used only for greedy drafting on CUDA, without data
parallelism, for batch sizes the runner has drafter graphs for, and when every draft attention
backend supports full graphs for single-token decoding and builds its metadata over the
buffers it is given (checked at capture); otherwise, or with
``GEMMA4_SPEC_FULL_DRAFT_GRAPHS=0``, the proposer drafts step by step as before. If a capture
fails, the reason is logged and the step-by-step path is used from then on; under tensor
parallelism, on every rank (``rank_agreement.py`` says why the ranks must agree).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.utils import record_function_or_nullcontext as scope

from gemma4_spec.compat import draft_metadata_rebuild_free
from gemma4_spec.log import get_logger
from gemma4_spec.ops.draft_inputs import DraftStepBuffers, DraftStepSources, stage_draft_inputs
from gemma4_spec.ops.graphed_launch import GraphedLaunches
from gemma4_spec.spec_decode.rank_agreement import first_failure, tensor_parallel_cpu_group
from gemma4_spec.switches import turned_off

if TYPE_CHECKING:
    from gemma4_spec.spec_decode.proposer import Gemma4Proposer

logger = get_logger(__name__)

FULL_DRAFT_GRAPHS_ENV = "GEMMA4_SPEC_FULL_DRAFT_GRAPHS"
PADDING_SLOT = -1  # vLLM's slot id for tokens that write no K/V


def loop_graph_size(batch_size: int, runner_size: int) -> int:
    """Rows of the draft-loop graph that drafts ``batch_size`` requests. The runner pads drafter
    batches to its capture sizes, which speculative decoding rounds up to multiples of 1 + k (at
    k = 2 one request drafts 3 rows, and the draft sampling takes its many-token path); these
    graphs are ours to size: powers of two up to 8, then multiples of 8, never more rows than
    the runner's size."""
    if batch_size <= 8:
        size = 1 << max(0, batch_size - 1).bit_length()
    else:
        size = -(-batch_size // 8) * 8
    return min(size, runner_size)


class DraftLoopGraphs:
    """Captured draft loops of one proposer, keyed by (padded batch size, k)."""

    def __init__(self, proposer: Gemma4Proposer) -> None:
        self._p = proposer
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self._buffers: DraftStepBuffers | None = None
        # The staging launch reads tensors the runner allocates anew each step, usually at the
        # same addresses again: a few graphs cover the steady state; past 16, it just launches.
        self.staging = GraphedLaunches("draft-input staging", max_graphs=16)
        self._gids: tuple[int, ...] = ()  # the draft's KV cache groups, one table buffer each
        self._backends_checked = False
        self.rebuild_free = False  # replays skip the metadata rebuild (see compat)
        self.replays = 0
        self.misses = 0  # batches drafted step by step because their size has no graph
        self.captured_at_startup = False
        self.disabled: str | None = self._unsupported_reason()
        if self.disabled is not None:
            logger.info("gemma4_spec: draft steps run one by one (%s).", self.disabled)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def _unsupported_reason(self) -> str | None:
        p = self._p
        if p.device.type != "cuda":
            return "no CUDA"
        if turned_off(FULL_DRAFT_GRAPHS_ENV):
            return f"{FULL_DRAFT_GRAPHS_ENV}=0"
        if p.vllm_config.parallel_config.data_parallel_size > 1:
            return "data parallelism"
        if p.vllm_config.model_config.enforce_eager:
            return "enforce_eager"
        return None

    def _backends_support_full_graphs(self) -> str | None:
        for group in self._p.draft_attn_groups:
            builder = group.backend.get_builder_cls()
            support = builder.get_cudagraph_support(self._p.vllm_config, group.kv_cache_spec)
            if support.value < AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE.value:
                return f"attention backend {group.backend.get_name()} has no full CUDA graphs"
        return None

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self._graphs.clear()
        logger.warning("gemma4_spec: full-graph drafting off (%s); drafting step by step.", reason)

    def draft(
        self,
        batch_size: int,
        size: int,
        k: int,
        common_metadata: CommonAttentionMetadata,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices: torch.Tensor,
        num_rejected_tokens: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Draft tokens ``[batch_size, k]`` from the graph of ``size`` rows (the padded batch
        size the runner has drafter graphs for, captured at start-up), or None when this batch
        must take the step-by-step path. Arguments as the proposer's ``propose`` gets
        them: the target step's metadata and tensors, each request's last accepted row
        (``token_indices``) and its rejected tokens."""
        if self.disabled is not None or not self._ready():
            return None
        p = self._p
        with scope("gemma4_spec: draft graph inputs"):
            sources = DraftStepSources(
                next_token_ids=next_token_ids,
                positions=target_positions,
                hidden=target_hidden_states,
                rows=token_indices,
                seq_lens=common_metadata.seq_lens,
                rejected=num_rejected_tokens,
                tables=tuple(p.block_table_of(gid, common_metadata) for gid in self.group_ids()),
            )
            buffers = self._buffers_for(sources.tables, size)
            hit = self._graphs.get((size, k))
            if buffers is None or hit is None:
                self.misses += 1
                return None
            stage_draft_inputs(sources, buffers, batch_size, size, self.staging)
        if not self.rebuild_free:
            metadata = p._one_query_per_request(common_metadata, token_indices, num_rejected_tokens)
            with scope("gemma4_spec: draft graph inputs"):
                self._metadata(metadata, batch_size, size)
        return self._replay(*hit, batch_size)

    def capture_at_startup(
        self, sizes: list[int], k: int, tables: tuple[torch.Tensor, ...]
    ) -> None:
        """Capture the loop of ``k`` steps for each of ``sizes`` rows, largest first (smaller
        graphs then reuse the pool's memory), over dummy requests: one key each, on the null
        block. ``tables`` are the runner's block tables of the draft's KV cache groups (the
        buffers take their widths). Runs once, while vLLM captures its graphs; later calls do
        nothing."""
        if self.captured_at_startup:
            return
        self.captured_at_startup = True
        if self.disabled is not None or not self._ready():
            return
        buffers = self._buffers_for(tables, max(sizes, default=0))
        if buffers is None:
            self._disable("the draft batch sizes exceed vLLM's largest capture size")
            return
        p = self._p
        for size in sorted(sizes, reverse=True):
            if (size, k) in self._graphs:
                continue
            # Dummy requests, as the staging writes padding rows.
            p.input_ids[:size].zero_()
            p.positions[:size].zero_()
            p.hidden_states[:size].zero_()
            buffers.seq_lens[:size].fill_(1)
            for table in buffers.tables:
                table[:size].zero_()
            metadata = CommonAttentionMetadata(
                query_start_loc=p.arange[: size + 1],
                query_start_loc_cpu=torch.from_numpy(p.token_arange_np[: size + 1]).clone(),
                seq_lens=buffers.seq_lens[:size],
                num_reqs=size,
                num_actual_tokens=size,
                max_query_len=1,
                max_seq_len=1,
                block_table_tensor=buffers.tables[0][:size],
                slot_mapping=torch.full((size,), PADDING_SLOT, dtype=torch.int64, device=p.device),
            )
            per_layer, slot_mapping = self._metadata(metadata, size, size)
            self._capture(size, k, metadata, per_layer, slot_mapping)
            if self.disabled is not None:
                return
        logger.info(
            "gemma4_spec: captured the whole greedy draft loop (%d steps) in CUDA graphs for "
            "%s requests",
            k,
            ", ".join(str(size) for size, _ in self.captured),
        )

    def _ready(self) -> bool:
        """Whether the draft attention backends allow the graphs (checked once, when they are
        known: at the first capture or draft)."""
        if not self._backends_checked:
            self._backends_checked = True
            reason = self._backends_support_full_graphs()
            if reason is not None:
                self._disable(reason)
                return False
            names = {group.backend.get_name() for group in self._p.draft_attn_groups}
            self.rebuild_free = draft_metadata_rebuild_free(names)
        return self.disabled is None

    def _replay(
        self, graph: torch.cuda.CUDAGraph, tokens: torch.Tensor, batch_size: int
    ) -> torch.Tensor:
        self.replays += 1
        with scope("gemma4_spec: draft graph replay"):
            graph.replay()
            return tokens[:batch_size].clone()

    # ----------------------------------------------------------------------------------------

    def group_ids(self) -> tuple[int, ...]:
        """The KV cache groups the draft layers read, ascending: one block-table buffer each."""
        if not self._gids:
            self._gids = tuple(
                sorted({group.kv_cache_group_id for group in self._p.draft_attn_groups})
            )
        return self._gids

    def _buffers_for(self, tables: tuple[torch.Tensor, ...], size: int) -> DraftStepBuffers | None:
        """The graphs' fixed input buffers (made at the first call, with the widths of the
        runner's block ``tables``), or None if ``size`` rows or these tables do not fit them."""
        p = self._p
        if self._buffers is None:
            capacity = p.vllm_config.compilation_config.max_cudagraph_capture_size
            self._buffers = DraftStepBuffers(
                input_ids=p.input_ids,
                positions=p.positions,
                hidden=p.hidden_states,
                seq_lens=torch.ones(capacity, dtype=torch.int32, device=p.device),
                tables=tuple(
                    torch.zeros(capacity, t.shape[1], dtype=t.dtype, device=p.device)
                    for t in tables
                ),
            )
        buffers = self._buffers
        if size > buffers.seq_lens.shape[0]:  # the drafter's sizes stay within vLLM's maximum
            return None
        for gid, table, source in zip(self.group_ids(), buffers.tables, tables, strict=True):
            if table.shape[1] != source.shape[1] or table.dtype != source.dtype:
                self._disable(f"block table width of KV cache group {gid} changed")
                return None
        return buffers

    def _metadata(
        self, metadata: CommonAttentionMetadata, batch_size: int, size: int
    ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """The draft layers' attention metadata over the staged buffers (``size`` rows), and the
        slot mapping of the forward context."""
        p = self._p
        assert self._buffers is not None
        tables = {gid: t[:size] for gid, t in zip(self._gids, self._buffers.tables, strict=True)}
        slot_mapping = p._get_slot_mapping(size, metadata.slot_mapping[:batch_size])
        padded = _pad_common_metadata(
            metadata,
            batch_size,
            query_start_loc=p.arange[: size + 1],
            query_start_loc_cpu=torch.from_numpy(p.token_arange_np[: size + 1]).clone(),
            seq_lens=self._buffers.seq_lens[:size],
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=p.vllm_config.model_config.max_model_len,
            slot_mapping=next(iter(slot_mapping.values())),
            positions=None if metadata.positions is None else p.positions[:size],
        )
        return p.metadata_over_tables(padded, tables)[1], slot_mapping

    def _loop(
        self,
        size: int,
        k: int,
        per_layer: dict[str, object],
        slot_mapping: dict[str, torch.Tensor],
        tokens: torch.Tensor,
    ) -> None:
        """The k draft steps over the first ``size`` rows, tokens into ``tokens[:, step]``."""
        p = self._p
        for step in range(k):
            draft_hidden, next_hidden = p._draft_step(
                per_layer, size, None, CUDAGraphMode.NONE, slot_mapping
            )
            step_tokens = p._greedy_sample(draft_hidden[:size])
            tokens[:, step] = step_tokens
            if step + 1 < k:
                p.input_ids[:size] = step_tokens
                p.hidden_states[:size] = next_hidden[:size]

    def _capture(
        self,
        size: int,
        k: int,
        metadata: CommonAttentionMetadata,
        per_layer: dict[str, object],
        slot_mapping: dict[str, torch.Tensor],
    ) -> None:
        """Capture the loop of ``k`` steps over ``size`` rows, or turn the graphs off. Under
        tensor parallelism the ranks agree before capturing and after (``rank_agreement.py``):
        all capture, or none; all keep their graphs, or none."""
        tokens = torch.zeros(size, k, dtype=torch.int64, device=self._p.device)
        reason, rebuilt = self._warm_up(size, k, metadata, per_layer, slot_mapping, tokens)
        reason = first_failure(reason, self._rank_group())
        if reason is not None:
            self._disable(reason)
            return
        graph, reason = self._record(size, k, rebuilt, tokens)
        reason = first_failure(reason, self._rank_group())
        if reason is not None or graph is None:
            self._disable(reason or f"capture of {size} x {k} failed")
            return
        self._graphs[(size, k)] = (graph, tokens)
        logger.debug("gemma4_spec: captured the draft loop for %d requests x %d steps", size, k)

    def _rank_group(self) -> Any | None:
        """The CPU process group of the tensor-parallel ranks (None with one rank)."""
        return tensor_parallel_cpu_group()

    def _warm_up(
        self,
        size: int,
        k: int,
        metadata: CommonAttentionMetadata,
        per_layer: dict[str, object],
        slot_mapping: dict[str, torch.Tensor],
        tokens: torch.Tensor,
    ) -> tuple[str | None, tuple[dict[str, object], dict[str, torch.Tensor]]]:
        """Run the loop once eagerly (kernels compile and per-weight state is built outside the
        capture; under vLLM's capture its custom all-reduce returns unwritten memory here, so
        the tokens are meaningless), then rebuild the metadata over the buffers. Returns why
        not to capture (None: capture) and the rebuilt (metadata, slot mapping)."""
        self._loop(size, k, per_layer, slot_mapping, tokens)
        rebuilt = self._metadata(metadata, size, size)
        moved = _moved_tensors(per_layer, rebuilt[0], self._p.device.type)
        if moved:
            return f"attention metadata built in fresh memory each step ({moved})", rebuilt
        return None, rebuilt

    def _record(
        self,
        size: int,
        k: int,
        rebuilt: tuple[dict[str, object], dict[str, torch.Tensor]],
        tokens: torch.Tensor,
    ) -> tuple[torch.cuda.CUDAGraph | None, str | None]:
        """The captured loop, or None and why the capture failed."""
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(self._p.device)
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._loop(size, k, rebuilt[0], rebuilt[1], tokens)
        except Exception as exc:  # keep serving: the step-by-step path computes the same
            return None, f"capture of {size} x {k} failed: {type(exc).__name__}: {exc}"
        return graph, None


def _pad_common_metadata(
    metadata: CommonAttentionMetadata, batch_size: int, **replacements: Any
) -> CommonAttentionMetadata:
    """``metadata`` with ``replacements``; any other optional per-request field (a tensor or
    array of ``batch_size`` or ``batch_size + 1`` rows) is dropped, since it would not match the
    padded batch."""
    for field in dataclasses.fields(metadata):
        if field.name in replacements or field.default is not None or not field.init:
            continue
        value = getattr(metadata, field.name)
        if isinstance(value, torch.Tensor | np.ndarray) and value.ndim > 0:
            if value.shape[0] in (batch_size, batch_size + 1):
                replacements[field.name] = None
    return dataclasses.replace(metadata, **replacements)


def _tensor_addresses(metadata: object, device_type: str) -> dict[str, int]:
    fields = vars(metadata) if hasattr(metadata, "__dict__") else {}
    return {
        name: value.data_ptr()
        for name, value in fields.items()
        if isinstance(value, torch.Tensor)
        and value.device.type == device_type
        and value.numel() > 0
    }


def _moved_tensors(first: dict[str, object], second: dict[str, object], device_type: str) -> str:
    """Names of metadata tensors whose memory differs between two builds over the same
    buffers ('' if none): a graph captured over the first would read stale memory."""
    for layer, built in first.items():
        a = _tensor_addresses(built, device_type)
        b = _tensor_addresses(second[layer], device_type)
        moved = sorted(name for name in a if b.get(name) != a[name])
        if moved:
            return f"{type(built).__name__}.{', '.join(moved)}"
    return ""
