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

``GEMMA4_SPEC_FLAT_VERIFY_FLATTEN=1`` instead rewrites the query tokens as one-token sequences
(``ops/flat_queries.py``) into buffers of fixed address: what this patch did before the split
kernel was found to take multi-token requests (kept for one A/B run on the GPU).

Only where the rewrite is the same at CUDA-graph capture and at replay: the decision depends
on the number of tokens (the graph's key) and ``max_query_len``; full graphs for mixed batches
(``cudagraph_mode`` FULL) would be captured with one ``max_query_len`` and replayed with
another, so that mode turns it off. Also off for: CPU, other speculative methods, more tokens
than the split kernel's scratch holds (``seq_threshold_3D`` query tokens) or than
``FLAT_VERIFY_MAX_TOKENS`` (where the split no longer pays), cascade attention, multimodal
prefix ranges, rolling sliding windows, decode context parallelism, micro-batching, KV-sharing
fast prefill (its metadata derives logits indices from the query layout), vLLM versions other
than ``compat.FLAT_VERIFY_VLLM``, and with ``GEMMA4_SPEC_FLAT_VERIFY=0``.

Both model runners: each builds the step's metadata through ``build`` before it replays a full
graph (with ``GEMMA4_SPEC_V2_DRAFT_LOOP=0``, V2 also for vLLM's draft prefill, which reuses the
target's metadata). vLLM versions: 0.26 (the class and the fields rewritten exist in 0.26 -
0.33).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from gemma4_spec.compat import flat_verify_supported
from gemma4_spec.log import get_logger
from gemma4_spec.ops.flat_queries import FlatQueryBuffers, flatten_queries
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp
from gemma4_spec.switches import turned_off

TRITON_ATTN_MODULE = "vllm.v1.attention.backends.triton_attn"
FLAT_VERIFY_ENV = "GEMMA4_SPEC_FLAT_VERIFY"
# Up to this many query tokens a verification batch goes to the decode kernel: where the whole
# engine ran faster with the rewrite than without it on the H200 (E2B shape, k = 3, real_work's
# ours-V2 against ours-V2-noflat: faster at 4 and 32 tokens, slower at 64; one layer alone,
# benchmarks/verify_attention.py, is faster up to 24 tokens and slower at 96). Figures in
# benchmarks/results/h200. Tunable with GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS.
FLAT_VERIFY_MAX_TOKENS = int(os.environ.get("GEMMA4_SPEC_FLAT_VERIFY_MAX_TOKENS", "32"))
FLATTEN_ENV = "GEMMA4_SPEC_FLAT_VERIFY_FLATTEN"

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
        flat = _flat_verify_of(self)
        if flat is None:
            return metadata
        common = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[1]
        return flat.rewrite(common, metadata)

    builder_cls.build = ours(build)


class FlatVerify:
    """One builder's rewrite of verification batches, with its own fixed-address buffers."""

    def __init__(self, max_query_len: int, capacity: int, flatten: bool = False) -> None:
        self.max_query_len = max_query_len
        self.capacity = capacity
        self.flatten = flatten
        self.rewrites = 0  # builds rewritten so far (the GPU engine test checks it is used)
        self._buffers: Any = None

    def applies(self, common: Any, metadata: Any) -> bool:
        # ``use_cascade``: 0.26's Triton metadata has it; from 0.32 the backend has no cascade
        # attention and no such field.
        return (
            1 < common.max_query_len <= self.max_query_len
            and common.num_actual_tokens <= self.capacity
            and not getattr(metadata, "use_cascade", False)
            and metadata.causal is True
            and getattr(metadata, "mm_prefix_range_tensor", None) is None
            and getattr(metadata, "rswa_prefix_lens", None) is None
        )

    def rewrite(self, common: Any, metadata: Any) -> Any:
        if not self.applies(common, metadata):
            return metadata
        _log_once()
        self.rewrites += 1
        if not self.flatten:
            metadata.max_query_len = 1
            return metadata
        table = metadata.block_table
        if self._buffers is None:  # the runner's block tables keep one width
            self._buffers = FlatQueryBuffers(self.capacity, table.shape[1], table.device)
        starts, lens, rows = flatten_queries(
            metadata.query_start_loc,
            metadata.seq_lens,
            table,
            common.num_actual_tokens,
            self._buffers,
        )
        metadata.query_start_loc = starts
        metadata.seq_lens = lens
        metadata.block_table = rows
        metadata.max_query_len = 1
        return metadata


# Attribute of a builder holding its FlatVerify (or None: the rewrite is off for it).
_STATE = "_gemma4_spec_flat_verify"


def _flat_verify_of(builder: Any) -> FlatVerify | None:
    """The builder's ``FlatVerify``, or None where the rewrite is off (decided once)."""
    if _STATE not in vars(builder):
        setattr(builder, _STATE, _make_flat_verify(builder))
    return vars(builder)[_STATE]


def rewrites_of(builder: Any) -> int:
    """How many of this builder's builds were rewritten (0 if it never built or is off)."""
    flat = vars(builder).get(_STATE)
    return 0 if flat is None else flat.rewrites


def flatten_replays_of(builder: Any) -> int:
    """How many of this builder's query flattenings were replayed from a CUDA graph."""
    flat = vars(builder).get(_STATE)
    return 0 if flat is None or flat._buffers is None else flat._buffers.launches.replays


def _make_flat_verify(builder: Any) -> FlatVerify | None:
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
    capacity = min(builder.seq_threshold_3D, FLAT_VERIFY_MAX_TOKENS)
    return FlatVerify(
        1 + spec.num_speculative_tokens, capacity, flatten=os.environ.get(FLATTEN_ENV) == "1"
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
