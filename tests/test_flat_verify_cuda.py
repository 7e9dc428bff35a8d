"""On CUDA with vLLM: the verification step's attention through vLLM's Triton kernel is the same
whether requests of ``1 + k`` query tokens go to its one-pass ("2D") kernel, as vLLM sends them,
or to its split-key ("3D") kernel as they are (``max_query_len`` 1: what
``patch/patch_triton_attn.py`` does). Skips elsewhere."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm.v1.attention.ops.triton_unified_attention")

from gemma4_spec.testing.triton_attention import PagedAttention  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "block_size", "window"), [(256, 16, 0), (256, 16, 64), (512, 64, 0)]
)
@pytest.mark.parametrize(("batch", "q_len"), [(1, 3), (8, 3), (32, 3), (8, 4), (25, 5)])
def test_verification_gives_the_same_attention_on_the_split_kernel(
    batch, q_len, head_dim, block_size, window, dtype
):
    torch.manual_seed(batch * 7 + head_dim + q_len)
    device = torch.device("cuda")
    heads, kv_heads, pad_reqs = 8, 1, 1
    seq_lens = torch.randint(q_len, 300, (batch,), device=device)
    blocks_per_req = (300 + block_size - 1) // block_size
    num_blocks = batch * blocks_per_req + 1
    table = torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_req] + 1
    table = table.view(batch, blocks_per_req)
    # Padded request: no query tokens, length 0, null-block row; padding tokens after.
    seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(pad_reqs)]).int()
    table = torch.cat([table, table.new_zeros(pad_reqs, blocks_per_req)]).int()
    starts = torch.arange(batch + 1, device=device) * q_len
    starts = torch.cat([starts, starts[-1:].repeat(pad_reqs)]).int()
    num_tokens = batch * q_len + 2
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    value_cache = torch.randn_like(key_cache)
    q = torch.randn(num_tokens, heads, head_dim, device=device).to(dtype)

    attention = PagedAttention(key_cache, value_cache, heads, window)
    longest = int(seq_lens.max())
    want = attention(q, starts, q_len, seq_lens, table, longest, torch.full_like(q, float("nan")))
    # The same requests through the split-key kernel (what max_query_len 1 makes vLLM pick).
    got = attention(q, starts, 1, seq_lens, table, longest, torch.full_like(q, float("nan")))

    real = batch * q_len
    # vLLM's kernel multiplies float32 in TF32 (tl.dot's default), and the two kernels tile
    # the keys differently: float32 results agree to TF32 rounding, not bit for bit.
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:real].float(), want[:real].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("head_dim", "window"), [(256, 0), (256, 64), (512, 0)])
@pytest.mark.parametrize("batch", [1, 8])
def test_one_query_steps_the_same_through_either_kernel(batch, head_dim, window):
    """The benchmark's one-pass decode row (``split_keys=False``) is the same attention as
    vLLM's split-key kernel, to the kernels' rounding."""
    torch.manual_seed(batch + head_dim + window)
    device, block_size, heads = torch.device("cuda"), 16, 8
    seq_lens = torch.randint(1, 300, (batch,), device=device).int()
    blocks_per_req = (300 + block_size - 1) // block_size
    table = (torch.arange(batch * blocks_per_req, device=device) + 1).view(batch, -1).int()
    key_cache = torch.randn(batch * blocks_per_req + 1, block_size, 1, head_dim, device=device)
    value_cache = torch.randn_like(key_cache)
    q = torch.randn(batch, heads, head_dim, device=device)
    starts = torch.arange(batch + 1, device=device).int()
    attention = PagedAttention(key_cache, value_cache, heads, window)
    longest = int(seq_lens.max())
    split = attention(q, starts, 1, seq_lens, table, longest)
    one_pass = attention(q, starts, 1, seq_lens, table, longest, split_keys=False)
    torch.testing.assert_close(one_pass, split, atol=1e-3, rtol=1e-3)  # TF32 in both
