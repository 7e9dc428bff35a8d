"""The Triton kernel of ``split_attention_reference`` (``ops/split_attention.py``).

``_split_attention_kernel``, grid ``(R, Hkv, cap)``: program ``(r, h, s)`` holds all of
request ``r``'s query tokens for the ``Hq / Hkv`` query heads of KV head ``h`` as the rows of one
block (``BLOCK_M`` >= q_len x group, at least 16, the smallest ``tl.dot`` side). The keys some
row attends are ``[lo, seq_len)``, ``lo`` the first token's window start (0 without a window);
they are cut into ``segments = min(cap, ceil(keys / MIN_KEYS))`` runs of whole ``TILE``s, and
program ``s`` walks run ``s`` with an online softmax (programs past ``segments`` return at
once). ``cap`` (``segment_cap``) is about one program an SM over the launch's requests x KV
heads, at most ``MAX_SEGMENTS``: the H100 sweep's best segment counts followed it. With one
segment the program writes the output. With several, each writes its rows' running maximum,
sum and float32 weighted values to scratch, and the program that brings the request and head's
last segment (an atomic counter) combines them in segment order (the result does not depend on
which came last), writes the output and sets the counter back to zero for the next launch or
graph replay: one launch where vLLM's split kernel takes two.

Counters are per device (``prepare_split_attention``, made outside any graph capture);
launches sharing them must not run concurrently on different streams. Under Triton's CPU
interpreter (``TRITON_INTERPRET=1``) programs run one after another on CPU tensors, so the
last-arriving combine still holds.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from gemma4_spec.ops.centroid_argmax_triton import (
    HAS_TRITON,
    _dot_precision,
    _interpreting,
    sm_count,
)
from gemma4_spec.ops.device_counters import device_counters

if HAS_TRITON:
    import triton
    import triton.language as tl

TILE = 64  # keys per step of a program's walk, where a tile of keys fits TILE_BYTES
TILE_BYTES = 64 * 1024  # one tile of keys (or values) in the key dtype, at most
MIN_KEYS = 64  # keys per segment, at least, before a request's keys are split further
MAX_SEGMENTS = 16
INTERPRET_SMS = 64  # "SM count" under the interpreter: several segments in small tests
COUNTER_CAPACITY = 8192  # requests x KV heads of one launch


class SplitAttentionConfig(NamedTuple):
    """Block sizes of one launch."""

    block_m: int  # rows: query tokens x query heads of one KV head, a power of two >= 16
    head_pad: int  # the head size, padded to a power of two: the tiles' width
    tile: int
    min_keys: int
    max_segments: int
    num_warps: int
    num_stages: int
    combine: int = 1  # segments' partial values the combining program loads at a time


# Cached: a launch outside a CUDA graph (a verification batch on piecewise graphs, eager mode)
# asks for its sizes every layer, and Triton's next_power_of_2 costs microseconds a call.
@functools.lru_cache(maxsize=64)
def split_attention_config(
    max_query_len: int,
    group: int,
    head_dim: int,
    max_segments: int = MAX_SEGMENTS,
    element_size: int = 2,
) -> SplitAttentionConfig:
    """Sizes for requests of up to ``max_query_len`` query tokens, ``max_segments`` (a power
    of two: the scratch's segments per row) and keys of ``element_size`` bytes."""
    block_m = max(16, triton.next_power_of_2(max_query_len * group))
    head_pad = padded_head(head_dim)
    tile = TILE
    while tile > 16 and tile * head_pad * element_size > TILE_BYTES:
        tile //= 2
    # The float32 accumulator is block_m x head floats a program: more warps to hold a large one.
    wide = block_m * head_pad >= 8192
    return SplitAttentionConfig(
        block_m, head_pad, tile, MIN_KEYS, max_segments, num_warps=8 if wide else 4, num_stages=2
    )


# A label of other sizes, e.g. "m128_w4": "t" keys a tile, "m" keys a segment at least, "w"
# warps, "s" pipeline stages, "c" partial values loaded at a time by the combine
# (``with_sizes``).
SIZE_FIELDS = {
    "t": "tile",
    "m": "min_keys",
    "w": "num_warps",
    "s": "num_stages",
    "c": "combine",
}


def parse_sizes(label: str) -> dict[str, int]:
    """The sizes a label names (``SIZE_FIELDS``); ValueError, saying what is accepted, for any
    other label."""
    sizes: dict[str, int] = {}
    for part in (p for p in label.split("_") if p):
        field, number = SIZE_FIELDS.get(part[0]), part[1:]
        if field is None or not number.isdigit() or int(number) < 1:
            raise ValueError(
                f"{label!r}: expected parts such as t64, m128, w4, s2, c2 joined by '_' (t: keys "
                "a tile, m: keys a segment at least, w: warps, s: pipeline stages, c: partial "
                "values the combine loads at a time)"
            )
        sizes[field] = int(number)
    tile = sizes.get("tile", TILE)
    if tile & (tile - 1) or tile < 16:
        raise ValueError(f"{label!r}: keys a tile must be a power of two, at least 16")
    return sizes


@functools.lru_cache(maxsize=64)
def with_sizes(config: SplitAttentionConfig, label: str) -> SplitAttentionConfig:
    """``config`` with the sizes ``label`` names (``parse_sizes``); ``config`` for ""."""
    return config._replace(**parse_sizes(label)) if label else config


def padded_head(head_dim: int) -> int:
    """The tiles' width for a head of ``head_dim``: the next power of two."""
    return 1 << (head_dim - 1).bit_length()


def scratch_fits(values: torch.Tensor, head_dim: int) -> bool:
    """Whether ``values`` can hold a head of ``head_dim``'s partial results: contiguous, each
    segment's row at least the tiles' width (it may be wider: vLLM's, sized for the model's
    largest head)."""
    return values.shape[-1] >= padded_head(head_dim) and values.is_contiguous()


def segment_cap(programs: int, device: torch.device, max_segments: int = MAX_SEGMENTS) -> int:
    """Segments a request at most, for ``programs`` (requests x KV heads): about one program
    an SM, so a small batch splits its keys over more programs (a shorter walk each) and a
    large one keeps each request's keys in fewer (less to write and combine)."""
    sms = sm_count(device, INTERPRET_SMS)
    return max(1, min(max_segments, sms // max(programs, 1)))


def prepare_split_attention(device: torch.device | str) -> torch.Tensor:
    """The device's (request, KV head) counters, zeroed and self-resetting, made once."""
    return device_counters("split_attention", device, COUNTER_CAPACITY)


if HAS_TRITON:

    @triton.jit
    def _split_attention_kernel(
        q_ptr,  # [T, Hq, D]
        k_ptr,  # [blocks, block_size, Hkv, D]
        v_ptr,
        out_ptr,  # [T, Hq, D]
        table_ptr,  # [R, max blocks]
        seq_lens_ptr,  # [R]
        starts_ptr,  # [R + 1]
        acc_ptr,  # [T, Hq, MAX_SEGMENTS, scratch_head >= HEAD_PAD] fp32 scratch
        max_ptr,  # [T, Hq, MAX_SEGMENTS] fp32 scratch
        sum_ptr,  # [T, Hq, MAX_SEGMENTS] fp32 scratch
        counter_ptr,  # [R * Hkv] int32, zero on entry and on exit
        scale,
        softcap,
        window,
        block_size,
        scratch_head,  # the scratch's last dimension: a segment's values, apart
        min_keys,  # keys per segment, at least
        cap,  # segments a request, at most (<= MAX_SEGMENTS)
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_table,
        NUM_HEADS: tl.constexpr,  # Hq
        GROUP: tl.constexpr,  # Hq / Hkv
        HEAD: tl.constexpr,  # D
        HEAD_PAD: tl.constexpr,  # HEAD padded to a power of two (not the scratch's width)
        BLOCK_M: tl.constexpr,
        TILE: tl.constexpr,
        MAX_SEGMENTS: tl.constexpr,
        SOFTCAP: tl.constexpr,
        WINDOWED: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        COMBINE: tl.constexpr,  # partial values loaded at a time by the combine
    ):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        first = tl.load(starts_ptr + r)
        q_len = tl.load(starts_ptr + r + 1) - first
        seq_len = tl.load(seq_lens_ptr + r)
        context = seq_len - q_len
        lo = 0
        if WINDOWED:
            lo = tl.maximum(context + 1 - window, 0)
        n_keys = seq_len - lo
        segments = tl.minimum(tl.maximum((n_keys + min_keys - 1) // min_keys, 1), cap)
        if (q_len > 0) & (s < segments):
            per = (n_keys + segments - 1) // segments
            per = (per + TILE - 1) // TILE * TILE
            k_begin = lo + s * per
            k_end = tl.minimum(seq_len, k_begin + per)

            offs_m = tl.arange(0, BLOCK_M)
            token = offs_m // GROUP
            head = h * GROUP + offs_m % GROUP
            row_ok = token < q_len
            offs_d = tl.arange(0, HEAD_PAD)
            d_ok = offs_d < HEAD
            row_at = (first + token).to(tl.int64)
            q = tl.load(
                q_ptr + row_at[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            if UPCAST:  # Triton's CPU interpreter mis-multiplies bfloat16 in tl.dot
                q = q.to(tl.float32)
            position = context + token

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
            table_row = table_ptr + r.to(tl.int64) * stride_table
            for start in range(k_begin, k_end, TILE):
                offs_n = start + tl.arange(0, TILE)
                n_ok = offs_n < k_end
                block = tl.load(table_row + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
                slot = offs_n % block_size
                kv_ok = n_ok[None, :] & d_ok[:, None]
                k = tl.load(
                    k_ptr
                    + block[None, :] * stride_kb
                    + slot[None, :] * stride_ks
                    + h * stride_kh
                    + offs_d[:, None],
                    mask=kv_ok,
                    other=0.0,
                )  # [HEAD_PAD, TILE]
                v = tl.load(
                    v_ptr
                    + block[:, None] * stride_vb
                    + slot[:, None] * stride_vs
                    + h * stride_vh
                    + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )  # [TILE, HEAD_PAD]
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                scores = tl.dot(q, k, input_precision=PRECISION) * scale
                if SOFTCAP:
                    # cap * tanh(x / cap), tanh through exp: 1 - 2 / (exp(2y) + 1)
                    scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
                allowed = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= position[:, None])
                if WINDOWED:
                    allowed = allowed & (offs_n[None, :] > position[:, None] - window)
                scores = tl.where(allowed, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(scores - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new

            out_at = out_ptr + row_at[:, None] * stride_ot + head[:, None] * stride_oh
            out_ok = row_ok[:, None] & d_ok[None, :]
            if segments == 1:
                total = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys: zeros
                tl.store(out_at + offs_d[None, :], total.to(out_ptr.dtype.element_ty), mask=out_ok)
            else:
                part = (row_at * NUM_HEADS + head) * MAX_SEGMENTS  # [BLOCK_M] first segment
                tl.store(max_ptr + part + s, m_i, mask=row_ok)
                tl.store(sum_ptr + part + s, l_i, mask=row_ok)
                tl.store(
                    acc_ptr + (part + s)[:, None] * scratch_head + offs_d[None, :],
                    acc,
                    mask=row_ok[:, None],
                )
                tl.debug_barrier()  # every thread's stores before the (releasing) counter update
                counter = counter_ptr + r * (NUM_HEADS // GROUP) + h
                done = tl.atomic_add(counter, 1, sem="acq_rel")
                if done == segments - 1:
                    # The last segment: combine all of them (written by other programs: read
                    # through L2, ".cg"), in segment order.
                    tl.debug_barrier()
                    # Every segment's maximum and sum in one load each (one round trip to L2,
                    # not one a segment), then the weighted values segment by segment.
                    segs = tl.arange(0, MAX_SEGMENTS)
                    seg_ok = row_ok[:, None] & (segs[None, :] < segments)
                    maxima = tl.load(
                        max_ptr + part[:, None] + segs[None, :],
                        mask=seg_ok,
                        other=float("-inf"),
                        cache_modifier=".cg",
                    )
                    sums = tl.load(
                        sum_ptr + part[:, None] + segs[None, :],
                        mask=seg_ok,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    top = tl.max(maxima, axis=1)
                    top = tl.where(top == float("-inf"), 0.0, top)
                    factors = tl.exp(maxima - top[:, None])  # 0 where masked
                    weight_sum = tl.sum(sums * factors, axis=1)
                    total = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
                    if COMBINE == 1:
                        for s2 in range(0, segments):
                            a_s = tl.load(
                                acc_ptr + (part + s2)[:, None] * scratch_head + offs_d[None, :],
                                mask=row_ok[:, None],
                                other=0.0,
                                cache_modifier=".cg",
                            )
                            factor = tl.sum(tl.where(segs[None, :] == s2, factors, 0.0), axis=1)
                            total += a_s * factor[:, None]
                    else:
                        # COMBINE segments' loads at a time (unrolled: issued together),
                        # summed in segment order all the same.
                        for s2 in range(0, segments, COMBINE):
                            for j in tl.static_range(COMBINE):
                                seg = s2 + j
                                live = row_ok & ((offs_m * 0 + seg) < segments)  # [BLOCK_M]
                                a_s = tl.load(
                                    acc_ptr
                                    + (part + seg)[:, None] * scratch_head
                                    + offs_d[None, :],
                                    mask=live[:, None],
                                    other=0.0,
                                    cache_modifier=".cg",
                                )
                                factor = tl.sum(
                                    tl.where(segs[None, :] == seg, factors, 0.0), axis=1
                                )
                                total += a_s * factor[:, None]
                    total = total / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None]
                    tl.store(
                        out_at + offs_d[None, :], total.to(out_ptr.dtype.element_ty), mask=out_ok
                    )
                    tl.store(counter, 0)


class SplitAttentionScratch(NamedTuple):
    """Float32 partial results of the segments: weighted values, maxima, sums."""

    # [T, Hq, MAX_SEGMENTS, W], W >= the head size padded to a power of two: vLLM's scratch,
    # which this may be, is as wide as the model's largest head (512 for Gemma 4's full layers)
    values: torch.Tensor
    maxima: torch.Tensor  # [T, Hq, MAX_SEGMENTS]
    sums: torch.Tensor


def split_attention_scratch(
    tokens: int, heads: int, head_dim: int, device: torch.device, width: int = 0
) -> SplitAttentionScratch:
    """Scratch for launches of up to ``tokens`` query tokens (allocate once, outside capture),
    ``width`` wide where that is more than the head needs (as vLLM's is, in the engine)."""
    padded = max(padded_head(head_dim), width)
    return SplitAttentionScratch(
        torch.empty(tokens, heads, MAX_SEGMENTS, padded, dtype=torch.float32, device=device),
        torch.empty(tokens, heads, MAX_SEGMENTS, dtype=torch.float32, device=device),
        torch.empty(tokens, heads, MAX_SEGMENTS, dtype=torch.float32, device=device),
    )


def split_attention(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [R, max blocks] int32
    seq_lens: torch.Tensor,  # [R] int32
    starts: torch.Tensor,  # [R + 1] int32
    max_query_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    scratch: SplitAttentionScratch | None = None,
    config: SplitAttentionConfig | None = None,
    sizes: str = "",
) -> torch.Tensor:
    """``split_attention_reference`` in one launch (module docstring). ``max_query_len`` bounds
    every request's query tokens (the rows of a program's block); ``config`` replaces
    ``split_attention_config``'s sizes (its ``block_m`` must hold ``max_query_len`` x group
    rows and its ``max_segments`` be at most the scratch's); ``sizes`` changes some of
    them (``with_sizes``)."""
    tokens, heads, head_dim = q.shape
    requests, kv_heads = seq_lens.shape[0], key_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if requests * kv_heads > COUNTER_CAPACITY:
        raise ValueError(f"split_attention: {requests} x {kv_heads} programs exceed the counters")
    counters = prepare_split_attention(q.device)
    if scratch is None:
        scratch = split_attention_scratch(tokens, heads, head_dim, q.device)
    cfg = with_sizes(
        config
        or split_attention_config(
            max_query_len, group, head_dim, scratch.values.shape[2], key_cache.element_size()
        ),
        sizes,
    )
    if cfg.block_m < max_query_len * group or cfg.max_segments > scratch.values.shape[2]:
        raise ValueError(f"split_attention: {cfg} cannot hold {max_query_len} x {group} rows")
    if not scratch_fits(scratch.values, cfg.head_pad):  # the tiles' width, as ``config`` has it
        raise ValueError(
            f"split_attention: a contiguous scratch at least {cfg.head_pad} wide is needed, "
            f"not {tuple(scratch.values.shape)}"
        )
    # On a GPU, Triton's default precision, as vLLM's attention kernel takes it (TF32 for
    # float32 operands), so that in float32 verification sees the attention plain decoding
    # computed; under the interpreter, the shared choice (float32 products, bfloat16 upcast).
    precision, upcast = _dot_precision(q) if _interpreting() else ("tf32", False)
    cap = segment_cap(requests * kv_heads, q.device, cfg.max_segments)
    grid = (requests, kv_heads, cap)
    _split_attention_kernel[grid](
        q, key_cache, value_cache, out, block_table, seq_lens, starts, scratch.values,
        scratch.maxima, scratch.sums, counters, scale, softcap, window, key_cache.shape[1],
        scratch.values.shape[-1], cfg.min_keys, cap,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), out.stride(0),
        out.stride(1), block_table.stride(0), NUM_HEADS=heads, GROUP=group, HEAD=head_dim,
        HEAD_PAD=cfg.head_pad, BLOCK_M=cfg.block_m, TILE=cfg.tile,
        MAX_SEGMENTS=cfg.max_segments, SOFTCAP=softcap > 0,
        WINDOWED=window > 0, PRECISION=precision, UPCAST=upcast, COMBINE=cfg.combine,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
