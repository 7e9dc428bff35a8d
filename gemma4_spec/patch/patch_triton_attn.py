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
query tokens of a decode batch, so that scratch traffic grows with it. Fewer segments mean
less of it, and longer walks over the keys per program; vLLM splits the whole sequence, not a
sliding layer's window, so as the context grows a sliding layer's window falls in fewer
programs. Hence the default for large verification batches (at least ``LARGE_VERIFY_TOKENS``
query tokens, within the builder's own split: 128 tokens on one KV head, as on the E2B shape
where it was measured, fewer on more): ``LARGE_VERIFY_SEGMENTS`` segments on the
full-attention layers, and the sliding-window layers on our split kernel
(``patch_split_attention``), whose segments cover the window only; smaller batches keep
vLLM's 16 on its kernel (``benchmarks/results/h100`` has the engine and one-layer figures
behind both). ``GEMMA4_SPEC_VERIFY_SEGMENTS`` (a power
of two from 1 to 16) gives every verification batch that many instead. Where a batch gets
fewer segments than the builder's, the rewrite views the builder's scratch with that many a
row (the same memory holds proportionally more query rows) and sets the metadata's segment
count, which the kernel and the reduction both take. A CUDA graph fixes the choice at capture,
by the batch's token count (its key), so it follows the batch size, never the context.

Both model runners: each builds the step's metadata through ``build`` before it replays a full
graph (with ``GEMMA4_SPEC_V2_DRAFT_LOOP=0``, V2 also for vLLM's draft prefill, which reuses the
target's metadata). vLLM versions: 0.26 (the class and the fields rewritten exist in 0.26 -
0.33).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from gemma4_spec.compat import flat_verify_supported
from gemma4_spec.log import get_logger
from gemma4_spec.patch import patch_split_attention
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_split_attention import (
    OWN_SPLIT_ATTR,
    TRITON_ATTN_MODULE,
    own_split_mode,
)
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp
from gemma4_spec.switches import turned_off
from gemma4_spec.validation import UnsupportedConfigurationError

FLAT_VERIFY_ENV = "GEMMA4_SPEC_FLAT_VERIFY"
# Up to this many query tokens a verification batch goes to the split kernel (and no more than
# its scratch holds: 128 rows for one KV head, fewer for more). 128 leaves the scratch as the
# bound on the E2B shape, where the split kernel ran the engine faster at 64 and 128 tokens
# once the engine waited on the GPU there (benchmarks/results/h200/README.md). Tunable with
# GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS.
SPLIT_VERIFY_MAX_TOKENS = int(os.environ.get("GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS", "128"))
SEGMENTS_ENV = "GEMMA4_SPEC_VERIFY_SEGMENTS"
SEGMENT_CHOICES = (1, 2, 4, 8, 16)
# Large verification batches: from this many query tokens (k=3 at B=16, k=2 at B=32 on the E2B
# shape), where the engine ran as fast or faster with their form than with vLLM's 16 segments;
# below it, at 24-48 tokens and at B=1, the two ran alike or the form lost (module docstring;
# benchmarks/results/h100, twenty-seventh session). Settable with
# GEMMA4_SPEC_LARGE_VERIFY_TOKENS (the GPU engine test lowers it to reach small batches).
LARGE_TOKENS_ENV = "GEMMA4_SPEC_LARGE_VERIFY_TOKENS"
LARGE_VERIFY_TOKENS = 64
LARGE_VERIFY_SEGMENTS = 4

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
        own_split: str | None = None,
        large_tokens: int = LARGE_VERIFY_TOKENS,
    ) -> None:
        self.max_query_len = max_query_len
        self.capacity = capacity  # query tokens the split kernel's scratch holds, at most
        # Softmax segments of every verification batch (GEMMA4_SPEC_VERIFY_SEGMENTS); None: the
        # default, LARGE_VERIFY_SEGMENTS for large batches, the builder's for the others.
        self.segments = segments
        # patch_split_attention's mode: which rewritten batches to mark for our kernel.
        self.own_split = own_split
        self.large_tokens = large_tokens
        self.rewrites = 0  # builds rewritten so far (the GPU engine test checks it is used)

    def is_large(self, common: Any) -> bool:
        return common.num_actual_tokens >= self.large_tokens

    def segments_for(self, common: Any, metadata: Any) -> int | None:
        """The batch's softmax segments, or None to keep the builder's."""
        wanted = self.segments
        if wanted is None and self.is_large(common):
            wanted = LARGE_VERIFY_SEGMENTS
        if wanted is None:
            return None
        return min(wanted, metadata.num_par_softmax_segments)

    def marks_own_split(self, common: Any) -> bool:
        """Whether the batch's attention goes to our kernel (on the layers its mode names)."""
        if self.own_split == "auto":
            return self.is_large(common)
        return self.own_split is not None

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
        # Only a segments setting lets more query tokens than the builder's split holds onto
        # the split kernel; the large-batch default stays within it (where vLLM splits: 128
        # tokens on one KV head, fewer on more, which the measurements did not cover).
        if self.applies(common, metadata, segments if self.segments is not None else None):
            _log_once()
            self.rewrites += 1
            metadata.max_query_len = 1
            if self.marks_own_split(common):  # patch_split_attention: our kernel runs it
                setattr(metadata, OWN_SPLIT_ATTR, self.max_query_len)
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
    own_split = own_split_mode()
    if own_split is not None:
        from gemma4_spec.ops.split_attention_triton import prepare_split_attention

        prepare_split_attention(builder.device)  # its counters, before any graph capture
        # The kernel call's routing, installed here (not at import) so that only engines
        # drafting with gemma4_mtp on CUDA pay for its wrapper.
        backend = sys.modules.get(TRITON_ATTN_MODULE)
        if backend is not None:
            patch_split_attention.apply(backend)
    return SplitKeyVerify(
        1 + spec.num_speculative_tokens,
        capacity,
        verify_segments_setting(),
        own_split,
        large_verify_tokens(),
    )


def verify_segments_setting() -> int | None:
    """``GEMMA4_SPEC_VERIFY_SEGMENTS`` read: None where unset (vLLM's segments), else a power of
    two from 1 to 16."""
    return _number_setting(
        SEGMENTS_ENV,
        lambda n: n in SEGMENT_CHOICES,
        f"one of {', '.join(map(str, SEGMENT_CHOICES))} (softmax segments of verification "
        "batches on the split kernel); unset it for vLLM's 16.",
    )


def large_verify_tokens() -> int:
    """``GEMMA4_SPEC_LARGE_VERIFY_TOKENS`` read: query tokens from which a verification batch
    is large (``LARGE_VERIFY_TOKENS`` where unset)."""
    tokens = _number_setting(
        LARGE_TOKENS_ENV,
        lambda n: n > 0,
        "a positive number of query tokens (from which a verification batch gets the "
        f"large-batch attention); unset it for {LARGE_VERIFY_TOKENS}.",
    )
    return LARGE_VERIFY_TOKENS if tokens is None else tokens


def _number_setting(name: str, accepts: Callable[[int], bool], expected: str) -> int | None:
    """The whole number in environment variable ``name``, None where unset; any value that is
    not a number ``accepts`` takes is refused, saying ``expected``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if value.isdigit() and accepts(int(value)):
        return int(value)
    raise UnsupportedConfigurationError(f"{name}={value!r}: expected {expected}")


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "gemma4_spec: verification attention runs through the Triton backend's split-key "
            "kernel; %s=0 turns this off.",
            FLAT_VERIFY_ENV,
        )
