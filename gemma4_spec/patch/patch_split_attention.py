"""Verification attention through our split kernel (``ops/split_attention_triton.py``).

By default on the sliding-window layers of large verification batches (at least
``patch_triton_attn.LARGE_VERIFY_TOKENS`` query tokens), which get fewer softmax segments
(``patch_triton_attn``): its segments cover a sliding layer's window, not the whole sequence
as vLLM's do, so a long context does not crowd the window into a few of the fewer segments
(one layer's timings in ``benchmarks/results/h100``; on short contexts vLLM's kernel at 4
segments ran the engine about as fast, and at 2048-token prompts slower).
``GEMMA4_SPEC_OWN_SPLIT_ATTENTION`` chooses otherwise: ``0`` never, ``1`` every layer of every
verification batch, ``sliding`` the sliding-window layers of every verification batch
(``auto``, the default, as above).

Wraps, once ``patch_triton_attn`` sets up a builder of an engine drafting with ``gemma4_mtp``
on CUDA, in ``vllm.v1.attention.backends.triton_attn``: ``TritonAttentionImpl.forward`` (to
know, for the duration of one layer's call, which batch's metadata it runs) and the module's
``unified_attention`` (the kernel call that ``forward`` makes). A batch that
``patch_triton_attn`` rewrote as a verification batch and marked for our kernel carries
``OWN_SPLIT_ATTR`` (its longest request's query tokens); its attention call goes to
``split_attention``, with vLLM's own split-kernel scratch (the same layout: query token x
query head x segment x head size) and the same arguments: queries, paged caches, block table,
key counts, query offsets, scale, window, soft-cap. Everything else goes to vLLM's kernel as
it was: batches without the mark, and calls with what our kernel does not do (a quantized KV
cache, ALiBi, attention sinks, query or output scales, multimodal prefixes, a non-causal mask,
chunked sliding windows).

Under CUDA graphs the choice is taken at capture, from the same batch mark as the rewrite's.
vLLM versions: ``compat.FLAT_VERIFY_VLLM`` (0.26), as the rewrite.

The draft's attention (one query a request, over the target's cache) can take our kernel too:
``GEMMA4_SPEC_OWN_DRAFT_ATTENTION`` = ``1`` (every draft layer), ``sliding`` (the draft's
sliding-window layers) or ``auto`` (every layer of draft batches of at least
``DRAFT_AUTO_ROWS`` requests, where one layer's timings favour it), off by default (``0``)
until the engine benchmark says otherwise. Our
V2 draft loop (``spec_decode/runner_v2.py``) marks its batches with ``mark_draft``; one launch
a layer where vLLM's split kernel takes two, and segments sized to the keys a request attends
(vLLM splits a short context into as many segments as a long one).

``GEMMA4_SPEC_SPLIT_ATTENTION_SIZES`` (e.g. ``m128_w4``) gives our kernel other block sizes
than its own, for timing them on the engine (``benchmarks/verify_attention.py --ours`` times
them on one layer).
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys
from types import ModuleType
from typing import Any

import torch

from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.validation import UnsupportedConfigurationError

OWN_SPLIT_ENV = "GEMMA4_SPEC_OWN_SPLIT_ATTENTION"
TRITON_ATTN_MODULE = "vllm.v1.attention.backends.triton_attn"
# The setting's values and modes: "all" (every layer) and "sliding" (the sliding-window layers)
# of every verification batch; "auto" the sliding-window layers of large ones.
OWN_SPLIT_MODES = {"1": "all", "sliding": "sliding", "auto": "auto"}
# The layers a mode sends to our kernel: all of them, or only those with a window.
SLIDING_ONLY_MODES = ("sliding", "auto")
# Set by patch_triton_attn on a rewritten verification batch's metadata that our kernel is to
# run: its longest request's query tokens (the rows of one program of our kernel).
OWN_SPLIT_ATTR = "_gemma4_spec_own_split"
SIZES_ENV = "GEMMA4_SPEC_SPLIT_ATTENTION_SIZES"  # our kernel's block sizes (``split_sizes``)
DRAFT_ENV = "GEMMA4_SPEC_OWN_DRAFT_ATTENTION"
DRAFT_MODES = {"1": "all", "sliding": "sliding", "auto": "auto"}
# The "auto" draft mode's smallest batch (requests, padding included) on our kernel: below it
# vLLM's split kernel ran a one-query layer as fast or faster (verify_attention.py --chain).
DRAFT_AUTO_ROWS = 16
# Set with OWN_SPLIT_ATTR by ``mark_draft`` on a draft batch's metadata: the layers our kernel
# runs for it ("all" or "sliding"), whatever the verification's mode.
DRAFT_ATTR = "_gemma4_spec_own_split_draft"
# unified_attention's arguments that our kernel leaves to vLLM's when they are set.
UNSUPPORTED_ARGS = (
    "alibi_slopes",
    "q_descale",
    "sinks",
    "qq_bias",
    "output_scale",
    "mm_prefix_range",
    "rswa_prefix_lens",
    "k_scale_cache",
    "v_scale_cache",
)

_metadata: contextvars.ContextVar[Any] = contextvars.ContextVar("gemma4_spec_attention_metadata")
_calls = 0  # attention calls this process sent to our kernel (at capture or eagerly)


def own_split_calls() -> int:
    """How many attention calls this process sent to our kernel (graph replays not counted)."""
    return _calls


def own_split_mode() -> str | None:
    """``GEMMA4_SPEC_OWN_SPLIT_ATTENTION`` read: None ("0": off), "all", "sliding" or "auto"
    (unset: the default)."""
    return _mode_setting(
        OWN_SPLIT_ENV,
        "auto",
        OWN_SPLIT_MODES,
        "auto (the default: the sliding-window layers of large verification batches through "
        "our split kernel), 1 (every layer's verification attention), sliding (the "
        "sliding-window layers' only) or 0 (vLLM's kernel).",
    )


def own_draft_mode() -> str | None:
    """``GEMMA4_SPEC_OWN_DRAFT_ATTENTION`` read: None (unset or "0": vLLM's kernel), "all",
    "sliding" or "auto" (``draft_layers`` says which batches)."""
    return _mode_setting(
        DRAFT_ENV,
        "0",
        DRAFT_MODES,
        "0 (the default: the draft's attention on vLLM's kernel), 1 (every draft layer on our "
        f"split kernel), sliding (the draft's sliding-window layers only) or auto (every layer "
        f"of draft batches of {DRAFT_AUTO_ROWS} requests or more).",
    )


def _mode_setting(name: str, default: str, modes: dict[str, str], expected: str) -> str | None:
    """The mode environment variable ``name`` names (``default`` where unset), None for "0";
    any other value is refused, saying ``expected``."""
    value = os.environ.get(name, "").strip() or default
    if value == "0":
        return None
    if value in modes:
        return modes[value]
    raise UnsupportedConfigurationError(f"{name}={value!r}: expected {expected}")


def split_sizes() -> str:
    """``GEMMA4_SPEC_SPLIT_ATTENTION_SIZES`` read: other block sizes for our kernel, as
    ``parse_sizes`` reads them (e.g. ``m128_w4``), "" where unset (the kernel's own)."""
    from gemma4_spec.ops.split_attention_triton import parse_sizes

    label = os.environ.get(SIZES_ENV, "").strip()
    try:
        parse_sizes(label)
    except ValueError as error:
        raise UnsupportedConfigurationError(
            f"{SIZES_ENV}={error}; unset it for the kernel's own sizes."
        ) from None
    return label


def route_draft(device: torch.device) -> str | None:
    """Where the draft's attention goes to our kernel, make it ready (the device's counters,
    outside any graph capture; the kernel call's routing, if vLLM's Triton backend is loaded)
    and return the mode for ``mark_draft``; None where it stays on vLLM's."""
    mode = own_draft_mode()
    backend = sys.modules.get(TRITON_ATTN_MODULE)
    if mode is None or device.type != "cuda" or backend is None:
        return None
    from gemma4_spec.ops.split_attention_triton import prepare_split_attention

    prepare_split_attention(device)
    apply(backend, draft=True)
    return mode


def draft_layers(mode: str | None, rows: int) -> str | None:
    """The layers (``mark_draft``'s mode) a draft batch of ``rows`` requests runs on our
    kernel under ``route_draft``'s ``mode``; None where it stays on vLLM's."""
    if mode != "auto":
        return mode
    return "all" if rows >= DRAFT_AUTO_ROWS else None


def mark_draft(metadata: Any, mode: str) -> None:
    """Send a draft batch's attention (one query token a request) to our kernel, on the
    layers ``mode`` names."""
    setattr(metadata, OWN_SPLIT_ATTR, 1)
    setattr(metadata, DRAFT_ATTR, mode)


def apply(module: ModuleType, draft: bool = False) -> None:
    """Route marked batches' attention calls to our kernel: the verification's, by
    ``own_split_mode``; with ``draft``, also where only the draft's marks need it."""
    mode = own_split_mode()
    if mode is None and not draft:
        return
    sliding_only = mode is None or mode in SLIDING_ONLY_MODES
    sizes = split_sizes()
    impl = getattr(module, "TritonAttentionImpl", None)
    if impl is None or is_ours(impl.forward):
        return
    original_forward = impl.forward
    original_attention = module.unified_attention

    @functools.wraps(original_forward)
    def forward(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        token = _metadata.set(attn_metadata)
        try:
            return original_forward(
                self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs
            )
        finally:
            _metadata.reset(token)

    @functools.wraps(original_attention)
    def unified_attention(*args: Any, **kwargs: Any) -> Any:
        metadata = _metadata.get(None)
        rows = getattr(metadata, OWN_SPLIT_ATTR, None)
        draft = getattr(metadata, DRAFT_ATTR, None)
        layers_sliding = sliding_only if draft is None else draft == "sliding"
        if (
            args
            or rows is None
            or (draft is None and mode is None)
            or not supported(kwargs)
            or (layers_sliding and _window_of(kwargs) == 0)
        ):
            return original_attention(*args, **kwargs)
        global _calls
        _calls += 1
        return run_split_attention(kwargs, rows, sizes)

    impl.forward = ours(forward)
    module.unified_attention = ours(unified_attention)


def supported(kwargs: dict[str, Any]) -> bool:
    """Whether our kernel computes this ``unified_attention`` call."""
    from gemma4_spec.ops.split_attention_triton import scratch_fits

    q, k = kwargs["q"], kwargs["k"]
    window = kwargs.get("window_size") or (-1, -1)
    return (
        k.dtype == q.dtype
        and kwargs.get("causal", True) is True
        and all(kwargs.get(name) is None for name in UNSUPPORTED_ARGS)
        and kwargs.get("chunk_lookback", -1) in (-1, None)
        and window[1] in (0, -1)
        and kwargs.get("softmax_segm_output") is not None
        and kwargs["softmax_segm_output"].shape[0] >= q.shape[0]
        # vLLM sizes its scratch for the model's largest head: wide enough wherever its own
        # kernel runs.
        and scratch_fits(kwargs["softmax_segm_output"], q.shape[-1])
    )


def _window_of(kwargs: dict[str, Any]) -> int:
    """The keys a query token attends back to, itself included (0: no window)."""
    left = (kwargs.get("window_size") or (-1, -1))[0]
    return left + 1 if left >= 0 else 0


def _scratch(kwargs: dict[str, Any]) -> Any:
    """vLLM's split-kernel scratch as our kernel's: the same memory, viewed with up to our
    ``MAX_SEGMENTS`` segments a row where it still has a row per query token. The batch's
    ``GEMMA4_SPEC_VERIFY_SEGMENTS`` view (fewer segments, more rows) is for vLLM's kernel; ours
    picks its own count, up to what the view allows."""
    from gemma4_spec.ops.split_attention_triton import MAX_SEGMENTS, SplitAttentionScratch
    from gemma4_spec.patch.patch_triton_attn import segment_views

    output = kwargs["softmax_segm_output"]
    maxima, sums = kwargs["softmax_segm_max"], kwargs["softmax_segm_expsum"]
    heads, segments, head = output.shape[1:]
    whole = heads * MAX_SEGMENTS * head
    if segments < MAX_SEGMENTS and output.numel() % whole == 0:
        if output.numel() // whole >= kwargs["q"].shape[0]:
            output, maxima, sums = segment_views(output, maxima, sums, MAX_SEGMENTS)
    return SplitAttentionScratch(output, maxima, sums)


def run_split_attention(kwargs: dict[str, Any], rows: int, sizes: str = "") -> Any:
    from gemma4_spec.ops.split_attention_triton import split_attention

    scratch = _scratch(kwargs)
    return split_attention(
        kwargs["q"],
        kwargs["k"],
        kwargs["v"],
        kwargs["block_table"],
        kwargs["seqused_k"],
        kwargs["cu_seqlens_q"],
        rows,
        kwargs["softmax_scale"],
        window=_window_of(kwargs),
        softcap=kwargs.get("softcap") or 0.0,
        out=kwargs["out"],
        scratch=scratch,
        sizes=sizes,
    )
