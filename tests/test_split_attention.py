"""Our split verification attention (``ops/split_attention*.py``) against its torch reference:
full and sliding-window layers, one and several segments, grouped heads, soft-capping, requests
of different lengths, padded requests, and the counters back at zero after every launch.

On CPU the kernel runs at small sizes under Triton's interpreter, in a subprocess; on CUDA at
E2B's head sizes too."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.split_attention import split_attention_reference

needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both
# (requests, query tokens each, head size, query heads, KV heads, longest, window, softcap)
SMALL_CASES = (
    (3, 4, 32, 8, 1, 300, 0, 0.0),  # several segments
    (3, 4, 32, 8, 1, 40, 0, 0.0),  # one segment
    (2, 3, 24, 4, 2, 600, 200, 0.0),  # window over several segments; head size not 2^n
    (2, 3, 32, 4, 2, 200, 50, 5.0),  # window shorter than the context, soft-cap
    (4, 1, 32, 8, 1, 150, 0, 0.0),  # one query token a request (a decode step)
)
E2B_CASES = (
    (32, 4, 256, 8, 1, 400, 512, 0.0),
    (16, 4, 256, 8, 1, 2100, 512, 0.0),
    (32, 3, 512, 8, 1, 2100, 0, 0.0),
    (1, 4, 512, 8, 1, 300, 0, 0.0),
    # Draft steps: one query token a request (GEMMA4_SPEC_OWN_DRAFT_ATTENTION).
    (8, 1, 512, 8, 1, 300, 0, 0.0),
    (8, 1, 256, 8, 1, 2100, 512, 0.0),
)


def _batch(case: tuple, dtype: torch.dtype, device: str, seed: int, block: int = 16) -> tuple:
    requests, q_len, head_dim, heads, kv_heads, longest, window, softcap = case
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(q_len, longest, (requests,), generator=gen)
    per_request = -(-longest // block)
    blocks = requests * per_request + 1
    table = (torch.randperm(blocks - 1, generator=gen) + 1).view(requests, per_request)
    # A padded request at the end: no query tokens, no keys (as a padded graph batch has).
    seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(1)])
    table = torch.cat([table, table.new_zeros(1, per_request)])
    starts = torch.cat([torch.arange(requests + 1) * q_len, torch.tensor([requests * q_len])])
    key_cache = torch.randn(blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(requests * q_len, heads, head_dim, generator=gen).to(dtype)
    tensors = [t.to(device) for t in (q, key_cache, value_cache)]
    ints = [t.int().to(device) for t in (table, seq_lens, starts)]
    return (*tensors, *ints, q_len, head_dim**-0.5, window, softcap)


def _check(cases: tuple, dtypes: tuple, device: str) -> None:
    from gemma4_spec.ops.device_counters import counters_of
    from gemma4_spec.ops.split_attention_triton import split_attention

    for i, case in enumerate(cases):
        for dtype in dtypes:
            q, k, v, table, seq_lens, starts, q_len, scale, window, softcap = _batch(
                case, dtype, device, seed=i
            )
            want = split_attention_reference(
                q, k, v, table, seq_lens, starts, scale, window, softcap
            )
            got = split_attention(q, k, v, table, seq_lens, starts, q_len, scale, window, softcap)
            # float32: the same sums in another order (TF32 products on CUDA); bfloat16: one
            # rounding of the output apart.
            tol = (1e-5 if device == "cpu" else 2e-3) if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"case {case} {dtype}")
            # Control: half the window (or one of 2 keys where there was none) is another
            # attention, and the comparison sees it.
            other = split_attention_reference(
                q, k, v, table, seq_lens, starts, scale, window // 2 if window else 2, softcap
            )
            assert (other.float() - got.float()).abs().max() > 10 * tol
            for counters in counters_of("split_attention"):
                assert not counters.any(), counters.nonzero().tolist()


def _check_kernel_against_reference(device: str) -> None:
    _check(SMALL_CASES, (torch.float32, torch.bfloat16), device)
    _check_fewer_segments(device)
    _check_wide_scratch(SMALL_CASES[0], device)
    _check_sizes(SMALL_CASES[2], device)


def _check_sizes(case: tuple, device: str) -> None:
    """Other block sizes (GEMMA4_SPEC_SPLIT_ATTENTION_SIZES): short tiles and segments (many
    segments), one segment a request, fewer warps and stages, the combine's loads two and four
    at a time (over segment counts they do not divide): the same attention."""
    from gemma4_spec.ops.split_attention_triton import split_attention

    q, k, v, table, seq_lens, starts, q_len, scale, window, softcap = _batch(
        case, torch.float32, device, seed=3
    )
    want = split_attention_reference(q, k, v, table, seq_lens, starts, scale, window, softcap)
    tol = 1e-5 if device == "cpu" else 2e-3
    for sizes in ("t16_m16_w4_s1", "m4096", "t32_s3", "c2", "t16_m16_c4"):
        got = split_attention(
            q, k, v, table, seq_lens, starts, q_len, scale, window, softcap, sizes=sizes
        )
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=sizes)


def _check_fewer_segments(device: str) -> None:
    """A scratch of 4 segments a row (vLLM's, viewed for GEMMA4_SPEC_VERIFY_SEGMENTS=4, where
    the rows do not suffice for 16) caps the segments at 4: the same attention."""
    from gemma4_spec.ops.split_attention_triton import split_attention, split_attention_scratch

    q, k, v, table, seq_lens, starts, q_len, scale, window, softcap = _batch(
        SMALL_CASES[0], torch.float32, device, seed=0
    )
    full = split_attention_scratch(q.shape[0], q.shape[1], q.shape[2], q.device)
    four = type(full)(*(t.view(-1, *t.shape[1:2], 4, *t.shape[3:]) for t in full))
    got = split_attention(q, k, v, table, seq_lens, starts, q_len, scale, scratch=four)
    want = split_attention_reference(q, k, v, table, seq_lens, starts, scale)
    tol = 1e-5 if device == "cpu" else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _wide_scratch(q: torch.Tensor, widen: int) -> object:
    """A scratch ``widen`` times as wide as the head needs, as vLLM's is on Gemma 4's sliding
    layers (sized for the model's largest head, 512, where they have 256), filled with what
    no segment writes."""
    from gemma4_spec.ops.split_attention_triton import padded_head, split_attention_scratch

    tokens, heads, head_dim = q.shape
    wide = split_attention_scratch(tokens, heads, head_dim, q.device, padded_head(head_dim) * widen)
    wide.values.fill_(7.0)
    return wide


def _check_wide_scratch(case: tuple, device: str) -> None:
    """Segments' partial values laid out at the scratch's width: the same attention."""
    from gemma4_spec.ops.split_attention_triton import split_attention

    q, k, v, table, seq_lens, starts, q_len, scale, window, softcap = _batch(
        case, torch.float32, device, seed=0
    )
    got = split_attention(
        q, k, v, table, seq_lens, starts, q_len, scale, window, softcap, scratch=_wide_scratch(q, 2)
    )
    want = split_attention_reference(q, k, v, table, seq_lens, starts, scale, window, softcap)
    tol = 1e-5 if device == "cpu" else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_tiles_follow_the_head_not_the_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On vLLM's scratch, twice as wide as a sliding layer's head, the launch's tiles are still
    the head's width (wider ones double the work and the registers) and the scratch's width is
    passed as its stride."""
    from gemma4_spec.ops import split_attention_triton as m

    launches: list[tuple[tuple, dict]] = []

    class Recorder:
        def __getitem__(self, grid: tuple) -> object:
            return lambda *args, **kwargs: launches.append((args, kwargs))

    monkeypatch.setattr(m, "_split_attention_kernel", Recorder())
    q, k, v, table, seq_lens, starts, q_len, scale, _, _ = _batch(
        E2B_CASES[0], torch.bfloat16, "cpu", seed=0
    )
    scratch = _wide_scratch(q, 2)
    m.split_attention(q, k, v, table, seq_lens, starts, q_len, scale, scratch=scratch)
    ((args, kwargs),) = launches
    assert kwargs["HEAD_PAD"] == 256
    # No window, no other size of 512 (strides, blocks): the one int of 512 is the scratch's.
    assert [a for a in args if isinstance(a, int)].count(512) == 1
    with pytest.raises(ValueError, match="at least 256 wide"):
        narrow = type(scratch)(scratch.values[..., :128].contiguous(), *scratch[1:])
        m.split_attention(q, k, v, table, seq_lens, starts, q_len, scale, scratch=narrow)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA tests cover it)")
def test_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_split_attention", "_check_kernel_against_reference")


@needs_cuda
def test_kernel_matches_reference_cuda() -> None:
    _check(SMALL_CASES + E2B_CASES, (torch.float32, torch.bfloat16), "cuda")
    _check_fewer_segments("cuda")
    _check_wide_scratch(E2B_CASES[0], "cuda")
    _check_sizes(E2B_CASES[0], "cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_sizes_reach_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sizes label changes those sizes of the launch and no others; a label that names
    anything else is refused, saying what it accepts."""
    from gemma4_spec.ops import split_attention_triton as m

    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid: tuple) -> object:
            return lambda *args, **kwargs: launches.append(dict(kwargs, min_keys=args[16]))

    monkeypatch.setattr(m, "_split_attention_kernel", Recorder())
    q, k, v, table, seq_lens, starts, q_len, scale, _, _ = _batch(
        E2B_CASES[0], torch.bfloat16, "cpu", seed=0
    )
    for sizes in ("", "m128_w4", "t32_s3_c4"):
        m.split_attention(q, k, v, table, seq_lens, starts, q_len, scale, sizes=sizes)
    picked = [
        (c["TILE"], c["min_keys"], c["num_warps"], c["num_stages"], c["COMBINE"]) for c in launches
    ]
    assert picked == [(64, 64, 8, 2, 1), (64, 128, 4, 2, 1), (32, 64, 8, 3, 4)]
    for bad in ("x4", "m", "m0", "t48", "t8", "m128-w4"):
        with pytest.raises(ValueError, match="t64, m128, w4, s2, c2|power of two"):
            m.parse_sizes(bad)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_segment_cap_gives_each_sm_about_one_program(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemma4_spec.ops import split_attention_triton as m

    monkeypatch.setattr(m, "sm_count", lambda device, off_gpu: 132)
    cuda = torch.device("cuda")
    # E2B (one KV head) at B = 1 / 8 / 16 / 32 / 64 / 256
    caps = [m.segment_cap(b, cuda) for b in (1, 8, 16, 32, 64, 256)]
    assert caps == [16, 16, 8, 4, 2, 1]
    assert m.segment_cap(1, cuda, max_segments=8) == 8  # GEMMA4_SPEC_VERIFY_SEGMENTS's views
