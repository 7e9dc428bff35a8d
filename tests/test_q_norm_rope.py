"""The draft attention's fused query norm and rotary embedding (``ops/q_norm_rope*.py``): the
reference against vLLM's own modules, the kernel against the reference (under Triton's CPU
interpreter here, on CUDA where there is one), the fallback, the custom op under torch.compile
and the switch.

What "equal" means (``_assert_close``): the kernel sums each head's squares in another order
than torch and may contract products into fused multiply-adds, so its normed value may sit one
rounding step away from the reference's; the rotation carries that into the result before its
own rounding: within two rounding steps of the head's largest value.
"""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.q_norm_rope import (
    FUSED_QROPE_ENV,
    q_norm_rope,
    q_norm_rope_applies,
    q_norm_rope_reference,
)
from gemma4_spec.testing.closeness import per_head_excess

needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both
EPS = 1e-6
# (rows, heads, head_dim, rotary_dim): every value rotated; part of them (the rest pass through);
# a head size that is not a power of two; the E2B assistant's sliding and full layers.
SHAPES = ((1, 2, 16, 16), (5, 3, 32, 8), (3, 2, 24, 24), (2, 8, 256, 256), (1, 8, 512, 512))


def _assert_close(out: torch.Tensor, ref: torch.Tensor, head_dim: int) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    worst = per_head_excess(out, ref, head_dim)
    assert worst <= 0, f"off by {worst} beyond two roundings of a head's largest value"


def _operands(
    rows: int, heads: int, head_dim: int, rotary: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, heads * head_dim, generator=gen) * 3).to(device, dtype)
    weight = (1 + torch.rand(head_dim, generator=gen)).to(device, dtype)
    angles = torch.outer(torch.arange(64.0), 1.0 / (100.0 ** (torch.arange(rotary // 2) / 8)))
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device, dtype)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(device)
    return q, weight, cache, positions


def _check_kernel_against_reference(device: str) -> None:
    from gemma4_spec.ops.q_norm_rope_triton import q_norm_rope_kernel

    for dtype in (torch.float32, torch.bfloat16):
        for seed, (rows, heads, head_dim, rotary) in enumerate(SHAPES):
            q, w, cache, pos = _operands(rows, heads, head_dim, rotary, dtype, device, seed)
            assert q_norm_rope_applies(q, w, cache, pos, head_dim)
            out = q_norm_rope(q, w, cache, pos, EPS, head_dim)
            _assert_close(out, q_norm_rope_reference(q, w, cache, pos, EPS, head_dim), head_dim)
            assert torch.equal(out, q_norm_rope_kernel(q, w, cache, pos, EPS, head_dim))
        # Rows of a wider tensor (a strided view along the rows), and a row of zeros (a graph's
        # padding row: its RMS is eps alone).
        q, w, cache, pos = _operands(4, 2, 16, 16, dtype, device, 9)
        wide = torch.zeros(4, 48, dtype=dtype, device=device)
        wide[:3, :32] = q[:3]
        got = q_norm_rope(wide[:, :32], w, cache, pos, EPS, 16)
        ref = q_norm_rope_reference(wide[:, :32], w, cache, pos, EPS, 16)
        _assert_close(got, ref, 16)
        assert not got[3].any(), "a zero row stays zero"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_q_norm_rope", "_check_kernel_against_reference")


@needs_cuda
def test_kernel_matches_reference_cuda() -> None:
    _check_kernel_against_reference("cuda")


@needs_cuda
def test_graph_replay_cuda() -> None:
    q, w, cache, pos = _operands(8, 8, 256, 256, torch.bfloat16, "cuda", 0)
    want = q_norm_rope(q, w, cache, pos, EPS, 256)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = q_norm_rope(q, w, cache, pos, EPS, 256)
    graph.replay()
    assert torch.equal(replayed, want)


@pytest.mark.parametrize("rotary", [16, 8])
def test_reference_is_vllms_norm_and_rotary_embedding(rotary: int) -> None:
    """In float32 the definition is vLLM's query norm followed by its neox-style rotary
    embedding (the modules the assistant runs without the switch), for a standard rotary
    embedding and for Gemma 4's proportional one."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        _check_against_vllm(rotary)


def _check_against_vllm(rotary: int) -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    head_dim, heads, rows = 16, 3, 4
    gen = torch.Generator().manual_seed(rotary)
    norm = RMSNorm(head_dim, eps=EPS)
    norm.weight.data.copy_(1 + torch.rand(head_dim, generator=gen))
    kinds = {
        "default": dict(rope_type="default", rope_theta=100.0, partial_rotary_factor=rotary / 16),
        "proportional": dict(
            rope_type="proportional", rope_theta=100.0, partial_rotary_factor=rotary / 16
        ),
    }
    q = torch.randn(rows, heads * head_dim, generator=gen)
    positions = torch.tensor([0, 3, 17, 60])
    for kind, parameters in kinds.items():
        rope = get_rope(
            head_dim,
            max_position=64,
            rope_parameters=parameters,
            is_neox_style=True,
            dtype=torch.float32,
        )
        want = norm.forward_native(q.view(rows, heads, head_dim)).reshape(rows, -1)
        want, _ = rope.forward_native(positions, want, None)
        got = q_norm_rope_reference(
            q, norm.weight.data, rope.cos_sin_cache, positions, EPS, head_dim
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=kind)


def test_falls_back_to_the_reference() -> None:
    """On CPU without the interpreter, or for operands the kernel does not take, the op is the
    reference."""
    q, w, cache, pos = _operands(3, 2, 16, 16, torch.float32, "cpu", 0)
    ref = q_norm_rope_reference(q, w, cache, pos, EPS, 16)
    assert torch.equal(q_norm_rope(q, w, cache, pos, EPS, 16), ref)
    odd = torch.cat([cache, cache[:, :1]], dim=-1)  # an odd rotary width
    assert not q_norm_rope_applies(q, w, odd, pos, 16)
    assert not q_norm_rope_applies(q, w, cache, pos[:2], 16), "one position a row"
    assert not q_norm_rope_applies(q, w[:8], cache, pos, 16), "one weight a head value"


def test_custom_op_compiles_with_dynamic_rows() -> None:
    q, w, cache, pos = _operands(5, 2, 16, 16, torch.float32, "cpu", 1)

    def step(q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.ops.gemma4_spec.q_norm_rope(q * 2, w, cache, pos, EPS, 16) + 1

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    for rows in (5, 3):
        want = q_norm_rope_reference(q[:rows] * 2, w, cache, pos[:rows], EPS, 16) + 1
        torch.testing.assert_close(compiled(q[:rows], pos[:rows]), want)


def test_fused_q_rope_is_on_unless_turned_off_and_cuda_only(set_env) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from gemma4_spec.ops import q_norm_rope as module

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(16, max_position=64, rope_parameters=dict(rope_type="default"))
    set_env(FUSED_QROPE_ENV, None)
    assert not module.fuses_q_rope(rope, "cpu")
    assert not module.fuses_q_rope(rope, None)
    if torch.cuda.is_available() and HAS_TRITON:
        assert module.fuses_q_rope(rope, "cuda")  # on unless turned off
    set_env(FUSED_QROPE_ENV, "0")
    assert not module.fuses_q_rope(rope, "cuda")
