"""Paged causal attention of a verification batch (each request's ``1 + k`` query tokens against
its keys in the KV cache), defined in plain torch: what ``ops/split_attention_triton.py``
computes in one launch.

Request ``r`` has ``q_len = starts[r + 1] - starts[r]`` query tokens, the last ``q_len`` of its
``seq_lens[r]`` keys (their K/V already in the cache). Query token ``i`` sits at position
``p = seq_lens[r] - q_len + i`` and attends the keys at positions ``j <= p``, and with a sliding
window ``w > 0`` only ``j > p - w``. Key ``j``'s K/V are at slot ``j % block_size`` of cache
block ``block_table[r, j // block_size]``. Query head ``h`` reads KV head ``h // (Hq / Hkv)``.
Scores are ``scale * q . k``, soft-capped as ``cap * tanh(score / cap)`` when ``softcap > 0``,
and the softmax-weighted sum of V is the output, in ``q``'s dtype.

Why a kernel of our own (in the engine by default on the sliding-window layers of large
verification batches; ``patch/patch_split_attention.py``): vLLM's split-key kernel divides a
sequence's keys into a fixed number of segments, the whole sequence even for a sliding layer
(whose window then falls in a few of them as the context grows), and sums the segments in a
second launch. Ours splits only the keys some query token of the request attends, picks how
many segments from their count inside the kernel (so it follows the context under a CUDA
graph too), and the last segment program of a request and KV head to finish sums them.
"""

from __future__ import annotations

import torch


def split_attention_reference(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [R, max blocks] int
    seq_lens: torch.Tensor,  # [R] int, keys of each request including its query tokens
    starts: torch.Tensor,  # [R + 1] int, query token offsets
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``[T, Hq, D]`` attention output by the definition above (float32 maths)."""
    out = torch.zeros_like(q)
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // kv_heads
    for r in range(seq_lens.shape[0]):
        first, last = int(starts[r]), int(starts[r + 1])
        q_len, n_keys = last - first, int(seq_lens[r])
        if q_len == 0:
            continue
        positions = torch.arange(n_keys, device=q.device)
        blocks = block_table[r, positions // block_size].long()
        keys = key_cache[blocks, positions % block_size].float()  # [n_keys, Hkv, D]
        values = value_cache[blocks, positions % block_size].float()
        keys = keys.repeat_interleave(group, dim=1)  # [n_keys, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        query = q[first:last].float()  # [q_len, Hq, D]
        scores = torch.einsum("ihd,jhd->hij", query, keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        token_pos = n_keys - q_len + torch.arange(q_len, device=q.device)
        allowed = positions[None, :] <= token_pos[:, None]
        if window > 0:
            allowed &= positions[None, :] > token_pos[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[first:last] = torch.einsum("hij,jhd->ihd", weights, values).to(q.dtype)
    return out
