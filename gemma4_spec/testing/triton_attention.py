"""vLLM's Triton attention kernel called directly, as its backend calls it for one layer, for
the verification-attention test and benchmark (``patch/patch_triton_attn.py``). Needs CUDA and
vLLM."""

from __future__ import annotations

import torch

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
                THRESHOLD_3D, num_heads, SEGMENTS, padded, dtype=torch.float32, device=device
            ),
            softmax_segm_max=torch.empty(THRESHOLD_3D, num_heads, SEGMENTS, device=device),
            softmax_segm_expsum=torch.empty(THRESHOLD_3D, num_heads, SEGMENTS, device=device),
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
    ) -> torch.Tensor:
        """``split_keys=False``: one-query batches through the one-pass ("2D") kernel too,
        where vLLM splits each sequence's keys over several programs ("3D") up to its
        threshold of sequences: which of the two a short-context draft step wants."""
        out = torch.empty_like(q) if out is None else out
        scale = self._scale[: seq_lens.shape[0]]
        scratch = self._scratch if split_keys else {**self._scratch, "seq_threshold_3D": 0}
        self._attention(
            q=q, k=self.key_cache, v=self.value_cache, out=out, cu_seqlens_q=query_start_loc,
            max_seqlen_q=max_query_len, seqused_k=seq_lens, max_seqlen_k=max_seq_len,
            softmax_scale=q.shape[2] ** -0.5, causal=True,
            window_size=(self.window - 1, 0) if self.window else (-1, -1),
            block_table=block_table, softcap=0, q_descale=None, k_descale=scale,
            v_descale=scale, **scratch,
        )  # fmt: skip
        return out
