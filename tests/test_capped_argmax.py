"""``ops/capped_argmax``: the argmax of soft-capped logits from one read of the raw ones.

The reference is vLLM's soft-cap (``x / cap``, ``tanh``, ``* cap`` in the logits' dtype) with
``-inf`` (a suppressed token) kept, and ``argmax``. The kernel is held to it on CUDA (every
16-bit value capped bit for bit, then whole rows with ties planted across splits) and, for its
splits and ties, under Triton's CPU interpreter, whose ``tanh`` is not CUDA's: there the
exactness check must find it inexact and ``capped_argmax`` must run the reference."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops import capped_argmax as ca
from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON

needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both
CAP = 30.0  # Gemma 4's final_logit_softcapping
VOCAB = 262144


def test_the_cap_decides_ties_the_raw_logits_do_not_have() -> None:
    # Two logits far above the cap both saturate at 30.0 in bfloat16: the greedy token is the
    # smaller id, where the raw logits' argmax is the larger logit. Why the cap is not skipped.
    logits = torch.zeros(1, 8, dtype=torch.bfloat16)
    logits[0, 2] = 200.0
    logits[0, 5] = 300.0
    assert ca.soft_cap_reference(logits, CAP)[0, 2] == ca.soft_cap_reference(logits, CAP)[0, 5]
    assert ca.capped_argmax_reference(logits, CAP).tolist() == [2]
    assert logits.argmax(dim=-1).tolist() == [5]
    assert ca.capped_argmax(logits, CAP).tolist() == [2]  # whichever path runs here


def test_suppressed_tokens_lose_as_in_vllms_order() -> None:
    # vLLM's multimodal Gemma 4 caps the logits, then sets the suppressed tokens to -inf. Here
    # they are -inf before the cap: where every other logit saturates at -cap, a suppressed
    # token capped to -cap would tie and win by its smaller id.
    raw = torch.full((2, 8), -200.0, dtype=torch.bfloat16)
    raw[1, 5] = 3.0
    suppressed = [0, 1, 5]
    vllms = ca.soft_cap_reference(raw, CAP)
    vllms[:, suppressed] = float("-inf")
    ours = raw.clone()
    ours[:, suppressed] = float("-inf")
    assert vllms.argmax(dim=-1).tolist() == [2, 2]
    assert ca.capped_argmax_reference(ours, CAP).tolist() == [2, 2]
    assert ca.capped_argmax(ours, CAP).tolist() == [2, 2]  # whichever path runs here
    # The control: capping the -inf values too (vLLM's cap alone) picks a suppressed token.
    assert ca.soft_cap_reference(ours, CAP).argmax(dim=-1).tolist() == [0, 0]


def test_reference_without_a_cap_is_argmax() -> None:
    logits = torch.randn(4, 100)
    assert torch.equal(ca.capped_argmax_reference(logits, None), logits.argmax(dim=-1))


def test_check_values_cover_every_16_bit_value_but_nans_and_tiny_ones() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        values = ca.check_values(dtype, torch.device("cpu"))
        size = values.float().abs()
        assert not torch.isnan(values).any()
        assert bool(((size == 0) | (size >= ca.SMALLEST_CHECKED)).all())
        assert torch.isinf(values).sum() == 2
        assert values.unique().numel() >= 55000  # of 65536 patterns: NaNs and tiny ones left out
    f32 = ca.check_values(torch.float32, torch.device("cpu"))
    assert f32.numel() > ca.CHECK_FLOAT32_COUNT and bool(
        (f32.abs() <= 1e4).logical_or(f32.isinf()).all()
    )


def test_exactness_check_fails_when_one_value_is_capped_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The control: the check compares bit for bit, so one value off in the kernel's cap is found.
    import gemma4_spec.ops.capped_argmax_triton as kernels

    def capped_with_one_off(values: torch.Tensor, cap: float) -> torch.Tensor:
        out = ca.capped_values_reference(values, cap).clone()
        out.view(torch.int16)[len(out) // 2] += 1  # the next bfloat16 value
        return out

    def capped_right(values: torch.Tensor, cap: float) -> torch.Tensor:
        return ca.capped_values_reference(values, cap)

    monkeypatch.setattr(ca, "_EXACT", {})
    monkeypatch.setattr(kernels, "soft_cap_values", capped_with_one_off)
    assert not ca.cap_is_exact(torch.bfloat16, torch.device("cpu"), CAP)
    monkeypatch.setattr(ca, "_EXACT", {})
    monkeypatch.setattr(kernels, "soft_cap_values", ca.soft_cap_reference)  # caps -inf to -cap
    assert not ca.cap_is_exact(torch.bfloat16, torch.device("cpu"), CAP)
    monkeypatch.setattr(ca, "_EXACT", {})
    monkeypatch.setattr(kernels, "soft_cap_values", capped_right)
    assert ca.cap_is_exact(torch.bfloat16, torch.device("cpu"), CAP)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("rows", [1, 3, 17, 70, 300])
@pytest.mark.parametrize("vocab", [1, 2047, 2048, 5000, VOCAB])
def test_splits_cover_the_row_once(rows: int, vocab: int) -> None:
    from gemma4_spec.ops.capped_argmax_triton import BLOCK, MAX_SPLITS, split_count

    for per_sm, block in ((4, BLOCK), (16, 8192), (1, 1024)):
        splits, chunk = split_count(rows, vocab, torch.device("cpu"), per_sm, block)
        assert 1 <= splits <= MAX_SPLITS and chunk % block == 0
        assert (splits - 1) * chunk < vocab <= splits * chunk  # no empty split, nothing left out


def _planted(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random rows with ties planted: a row's maximum repeated across splits, a row whose
    values all saturate the cap, a row of -inf but one value, a row all -inf, a row rising
    far above the cap, a row saturating at -cap after suppressed (-inf) tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 20).to(dtype)
    if rows >= 4 and vocab >= 8:
        top = float(logits[0].float().max()) + 1.0
        for at in (vocab - 1, vocab // 2, vocab // 3):
            logits[0, at] = top
        logits[1] = 500.0  # every capped value 30.0: argmax 0
        logits[2] = float("-inf")
        logits[2, vocab - 2] = -5.0
        logits[3] = float("-inf")  # argmax of an all -inf row: 0
    if rows >= 5:
        # Rising along the row, every value far above the cap: each later tile raises the raw
        # maximum, none the capped one (30.0 in bfloat16 and float16): argmax 0.
        logits[4] = torch.linspace(400.0, 4000.0, vocab).to(dtype)
    if rows >= 6 and vocab >= 8:
        logits[5] = -200.0  # capped: -30.0 in bfloat16 and float16, all equal in float32
        logits[5, :3] = float("-inf")  # suppressed: the argmax is 3, not 0
    return logits.to(device)


def _check_kernel(device: str) -> None:
    """The kernel without a cap against the reference; with the cap, against the argmax of its
    own capped values (exact only where ``cap_is_exact``; the CUDA tests check that)."""
    from gemma4_spec.ops.capped_argmax_triton import capped_argmax_kernel, soft_cap_values

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, vocab in ((1, 3000), (5, 2048), (6, 9000), (40, 4100)):
            logits = _planted(rows, vocab, dtype, device, seed=rows * vocab)
            want = ca.capped_argmax_reference(logits, None)
            assert torch.equal(capped_argmax_kernel(logits, None), want), (dtype, rows, vocab)
            capped = soft_cap_values(logits.reshape(-1), CAP).reshape(logits.shape)
            got = capped_argmax_kernel(logits, CAP)
            assert torch.equal(got, capped.argmax(dim=-1)), (dtype, rows, vocab)
            if rows >= 6:  # the suppressed tokens before the saturated ones lose
                assert int(got[5]) == 3, (dtype, rows, vocab)
            # Rows of a wider buffer (a row stride above the vocabulary).
            wide = torch.zeros(rows, vocab + 64, dtype=dtype, device=device)
            wide[:, :vocab] = logits
            assert torch.equal(capped_argmax_kernel(wide[:, :vocab], None), want)


def _check_sizes(device: str) -> None:
    """Other splits, tiles and warps (``benchmarks/capped_argmax.py --sweep``'s): the same
    tokens as the defaults' reference."""
    from gemma4_spec.ops.capped_argmax_triton import capped_argmax_kernel, soft_cap_values

    for rows, vocab in ((6, 9000), (40, 4100)):
        logits = _planted(rows, vocab, torch.bfloat16, device, seed=rows + vocab)
        capped = soft_cap_values(logits.reshape(-1), CAP).reshape(logits.shape)
        # Two tiles an iteration too: an odd number of tiles a split (1024 at 9000 values
        # over the interpreter's splits) leaves the last iteration's second tile empty.
        for sizes in ((16, 4096, 4), (1, 1024, 8), (8, 8192, 8), (1, 1024, 8, 2), (8, 512, 4, 2)):
            got = capped_argmax_kernel(logits, CAP, *sizes)
            assert torch.equal(got, capped.argmax(dim=-1)), (rows, vocab, sizes)


def _check_fallback(device: str) -> None:
    """Under the interpreter the formula for tanh is not CUDA's: the check finds the kernel
    inexact, and ``capped_argmax`` gives the reference's tokens."""
    assert not ca.cap_is_exact(torch.bfloat16, torch.device(device), CAP)
    logits = _planted(6, 3000, torch.bfloat16, device, seed=1)
    assert not ca.kernel_applies(logits, CAP) and ca.kernel_applies(logits, None)
    assert torch.equal(ca.capped_argmax(logits, CAP), ca.capped_argmax_reference(logits, CAP))


def _check_under_interpreter(device: str) -> None:
    _check_kernel(device)
    _check_sizes(device)
    _check_fallback(device)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA tests cover it)")
def test_kernel_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_capped_argmax", "_check_under_interpreter")


def test_without_triton_or_cuda_the_reference_runs() -> None:
    logits = _planted(5, 3000, torch.float32, "cpu", seed=2)
    assert not ca.kernel_applies(logits, CAP)  # CPU tensors, no interpreter
    assert torch.equal(ca.capped_argmax(logits, CAP), ca.capped_argmax_reference(logits, CAP))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_cap_is_exact(dtype: torch.dtype) -> None:
    # Every bfloat16 / float16 value (and a spread of float32 ones) capped bit for bit as torch
    # caps it on this device: what lets the engine use the kernel.
    assert ca.cap_is_exact(dtype, torch.device("cuda"), CAP)


@needs_cuda
def test_cuda_kernel_small_shapes() -> None:
    _check_kernel("cuda")
    _check_sizes("cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 9, 32, 96, 128, 256])
def test_cuda_real_vocabulary_matches_reference(rows: int, dtype: torch.dtype) -> None:
    logits = _planted(rows, VOCAB, dtype, "cuda", seed=rows)
    assert torch.equal(ca.capped_argmax(logits, CAP), ca.capped_argmax_reference(logits, CAP))
    assert torch.equal(ca.capped_argmax(logits, None), logits.argmax(dim=-1))
