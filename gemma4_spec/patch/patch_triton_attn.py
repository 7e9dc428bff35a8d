"""Verification attention on vLLM's Triton backend through its split-key ("3D") kernel.

Wraps: ``vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.build``. The
original builds the metadata; when the batch is a gemma4_mtp verification step (at most
``1 + k`` query tokens per request, some request with more than one), ``max_query_len``
becomes 1. vLLM's Triton attention picks its kernel by it: for ``q_len > 1`` one program per
request and KV head walks all of the request's keys ("2D"), which leaves most of the GPU idle
at small batches; for decode batches it splits every sequence's keys over several programs and
reduces their partial softmaxes ("3D"). The split kernel itself is general in the query: each
program loads a block of a request's query tokens, masks keys causally per token
(``context_len + token index``) and writes partial results per query token, which the
reduction combines per token; only vLLM's choice of kernel sends multi-token requests to the
one-pass kernel. So the step is the same attention (``tests/test_flat_verify_cuda.py`` holds
the two kernels to each other), on the split kernel.

Only where the rewrite is the same at CUDA-graph capture and at replay: the decision depends
on the number of tokens (the graph's key) and ``max_query_len``; full graphs for mixed batches
(``cudagraph_mode`` FULL) would be captured with one ``max_query_len`` and replayed with
another, so that mode turns it off. Also off for: CPU, other speculative methods, more tokens
than the split kernel's scratch holds (``seq_threshold_3D`` query tokens) or than
``SPLIT_VERIFY_MAX_TOKENS`` (where the split no longer pays), cascade attention, multimodal
prefix ranges, rolling sliding windows, decode context parallelism, micro-batching, KV-sharing
fast prefill (its metadata derives logits indices from the query layout), vLLM versions other
than ``compat.FLAT_VERIFY_VLLM``, and with ``GEMMA4_SPEC_FLAT_VERIFY=0`` (the switch keeps the name
of the first version of this patch, which rewrote each query token as a one-token sequence).

Softmax segments: vLLM's split kernel divides each sequence's keys into 16 segments, and for
every query token and head writes each segment's float32 partial output, which a second kernel
(``reduce_segments``) reads back and combines. A verification batch has ``1 + k`` times the
query tokens of a decode batch, so that scratch traffic grows with it, while the programs it
buys (query blocks x KV heads x segments) fill the GPU with fewer segments once the batch is
large. ``GEMMA4_SPEC_VERIFY_SEGMENTS`` sets the segments of verification batches: unset, vLLM's
16; a power of two from 1 to 16; or ``auto``, the fewest that still give about
``AUTO_SEGMENT_WAVES`` programs per SM (``verify_segments``). The rewrite then views the
builder's scratch with that many segments (the same memory holds proportionally more query
rows) and sets the metadata's segment count, which the kernel and the reduction both take.

Both model runners: each builds the step's metadata through ``build`` before it replays a full
graph (with ``GEMMA4_SPEC_V2_DRAFT_LOOP=0``, V2 also for vLLM's draft prefill, which reuses the
target's metadata). vLLM versions: 0.26 (the class and the fields rewritten exist in 0.26 -
0.33).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from gemma4_spec.compat import flat_verify_supported
from gemma4_spec.log import get_logger
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp
from gemma4_spec.switches import turned_off
from gemma4_spec.validation import UnsupportedConfigurationError

TRITON_ATTN_MODULE = "vllm.v1.attention.backends.triton_attn"
FLAT_VERIFY_ENV = "GEMMA4_SPEC_FLAT_VERIFY"
# Up to this many query tokens a verification batch goes to the split kernel (and no more than
# its scratch holds: 128 rows for one KV head, fewer for more). 128 leaves the scratch as the
# bound on the E2B shape, where the split kernel ran the engine faster at 64 and 128 tokens
# once the engine waited on the GPU there (benchmarks/results/h200/README.md). Tunable with
# GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS.
SPLIT_VERIFY_MAX_TOKENS = int(os.environ.get("GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS", "128"))
SEGMENTS_ENV = "GEMMA4_SPEC_VERIFY_SEGMENTS"
AUTO_SEGMENTS = "auto"
# ``auto``: split kernel programs per SM to aim for (module docstring).
AUTO_SEGMENT_WAVES = 2
# vLLM's Triton kernel puts this many query heads in one program's block of rows, at least
# (``BLOCK_M`` in 0.26's ``unified_attention``): with fewer heads per KV head, one program takes
# several query tokens.
KERNEL_BLOCK_M = 16

logger = get_logger(__name__)
_logged = False


def apply(module: ModuleType) -> None:
    builder_cls = getattr(module, "TritonAttentionMetadataBuilder", None)
    if builder_cls is None or is_ours(builder_cls.build):
        return
    original = builder_cls.build

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = original(self, *args, **kwargs)
        split = _split_verify_of(self)
        if split is None:
            return metadata
        common = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[1]
        return split.rewrite(common, metadata)

    builder_cls.build = ours(build)


class SplitKeyVerify:
    """One builder's rewrite of verification batches onto the split-key kernel."""

    def __init__(
        self,
        max_query_len: int,
        capacity: int,
        segments: int | None = None,
        shape: SplitShape | None = None,
    ) -> None:
        self.max_query_len = max_query_len
        self.capacity = capacity  # query tokens the split kernel's scratch holds, at most
        # Softmax segments of verification batches: None keeps the builder's; 0 picks them by
        # ``verify_segments`` for each batch (``shape`` then says the kernel's grid).
        self.segments = segments
        self.shape = shape
        self.rewrites = 0  # builds rewritten so far (the GPU engine test checks it is used)

    def segments_for(self, common: Any, metadata: Any) -> int | None:
        """The batch's softmax segments, or None to keep the builder's."""
        if self.segments is None:
            return None
        built: int = metadata.num_par_softmax_segments
        if self.segments == 0:
            assert self.shape is not None
            return verify_segments(common.num_actual_tokens, common.num_reqs, self.shape, built)
        return min(self.segments, built)

    def applies(self, common: Any, metadata: Any, segments: int | None = None) -> bool:
        # ``use_cascade``: 0.26's Triton metadata has it; from 0.32 the backend has no cascade
        # attention and no such field.
        return (
            1 < common.max_query_len <= self.max_query_len
            and common.num_actual_tokens <= self.capacity_at(metadata, segments)
            and not getattr(metadata, "use_cascade", False)
            and metadata.causal is True
            and getattr(metadata, "mm_prefix_range_tensor", None) is None
            and getattr(metadata, "rswa_prefix_lens", None) is None
        )

    def capacity_at(self, metadata: Any, segments: int | None) -> int:
        """Query tokens a batch may have at ``segments``: the cap, and the scratch's rows."""
        if segments is None or segments == metadata.num_par_softmax_segments:
            return self.capacity
        rows = metadata.softmax_segm_max.shape[0] * metadata.num_par_softmax_segments
        return min(rows // segments, SPLIT_VERIFY_MAX_TOKENS)

    def rewrite(self, common: Any, metadata: Any) -> Any:
        segments = self.segments_for(common, metadata)
        if self.applies(common, metadata, segments):
            _log_once()
            self.rewrites += 1
            metadata.max_query_len = 1
            if segments is not None and segments != metadata.num_par_softmax_segments:
                views = segment_views(
                    metadata.softmax_segm_output,
                    metadata.softmax_segm_max,
                    metadata.softmax_segm_expsum,
                    segments,
                )
                metadata.num_par_softmax_segments = segments
                (
                    metadata.softmax_segm_output,
                    metadata.softmax_segm_max,
                    metadata.softmax_segm_expsum,
                ) = views
        return metadata


@dataclass(frozen=True)
class SplitShape:
    """What the split kernel's grid depends on besides the batch: its programs are query blocks
    x KV heads x segments."""

    query_heads: int
    kv_heads: int
    sms: int


def verify_segments(num_tokens: int, num_reqs: int, shape: SplitShape, most: int) -> int:
    """The fewest softmax segments (a power of two, at most ``most``) that give the split
    kernel about ``AUTO_SEGMENT_WAVES`` programs per SM for a batch of ``num_tokens`` query
    tokens in ``num_reqs`` requests: fewer segments write and reduce less scratch, more keep
    the GPU busy."""
    per_kv = max(1, shape.query_heads // shape.kv_heads)
    block_q = max(1, KERNEL_BLOCK_M // per_kv)
    # vLLM's grid: an upper bound of query blocks (each request's last block may be partial).
    programs = (num_tokens // block_q + num_reqs) * shape.kv_heads
    want = -(-AUTO_SEGMENT_WAVES * shape.sms // max(1, programs))
    segments = 1
    while segments < want and segments < most:
        segments *= 2
    return segments


def segment_views(
    output: torch.Tensor, maxima: torch.Tensor, expsums: torch.Tensor, segments: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's scratch (``[rows, heads, built segments, head]`` partial outputs,
    ``[rows, heads, built segments]`` maxima and sums) laid out for ``segments`` per row:
    the same memory, ``built / segments`` times the rows."""
    heads, head = output.shape[1], output.shape[3]
    return (
        output.view(-1, heads, segments, head),
        maxima.view(-1, heads, segments),
        expsums.view(-1, heads, segments),
    )


# Attribute of a builder holding its SplitKeyVerify (or None: the rewrite is off for it).
_STATE = "_gemma4_spec_split_verify"


def _split_verify_of(builder: Any) -> SplitKeyVerify | None:
    """The builder's ``SplitKeyVerify``, or None where the rewrite is off (decided once)."""
    if _STATE not in vars(builder):
        setattr(builder, _STATE, _make_split_verify(builder))
    return vars(builder)[_STATE]


def rewrites_of(builder: Any) -> int:
    """How many of this builder's builds were rewritten (0 if it never built or is off)."""
    split = vars(builder).get(_STATE)
    return 0 if split is None else split.rewrites


def _make_split_verify(builder: Any) -> SplitKeyVerify | None:
    from vllm.config import CUDAGraphMode

    config = builder.vllm_config
    spec = config.speculative_config
    parallel = config.parallel_config
    if (
        turned_off(FLAT_VERIFY_ENV)
        or builder.device.type != "cuda"
        or spec is None
        or not drafts_with_gemma4_mtp(config)  # vLLM renames the method "mtp"
        or not flat_verify_supported()
        or config.compilation_config.cudagraph_mode.mixed_mode() == CUDAGraphMode.FULL
        or getattr(parallel, "decode_context_parallel_size", 1) > 1
        or getattr(parallel, "enable_dbo", False)
        or getattr(config.cache_config, "kv_sharing_fast_prefill", False)
        or getattr(builder, "rswa_window", None) is not None
        or getattr(builder, "softmax_segm_output", None) is None
        or not getattr(builder, "seq_threshold_3D", 0)
    ):
        return None
    # The split kernel's scratch has a row per query token for seq_threshold_3D tokens.
    capacity = min(builder.seq_threshold_3D, SPLIT_VERIFY_MAX_TOKENS)
    segments = verify_segments_setting()
    shape = None
    if segments == 0:
        sms = torch.cuda.get_device_properties(builder.device).multi_processor_count
        shape = SplitShape(builder.num_heads_q, builder.num_heads_kv, sms)
    return SplitKeyVerify(1 + spec.num_speculative_tokens, capacity, segments, shape)


def verify_segments_setting() -> int | None:
    """``GEMMA4_SPEC_VERIFY_SEGMENTS`` read: None (unset: vLLM's), 0 (``auto``) or a power of
    two from 1 to 16."""
    value = os.environ.get(SEGMENTS_ENV, "").strip().lower()
    if not value:
        return None
    if value == AUTO_SEGMENTS:
        return 0
    if value.isdigit() and int(value) in (1, 2, 4, 8, 16):
        return int(value)
    raise UnsupportedConfigurationError(
        f"{SEGMENTS_ENV}={value!r}: expected a power of two from 1 to 16 (softmax segments "
        f"of verification batches) or {AUTO_SEGMENTS!r}; unset it for vLLM's 16."
    )


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "gemma4_spec: verification attention runs through the Triton backend's split-key "
            "kernel; %s=0 turns this off.",
            FLAT_VERIFY_ENV,
        )
