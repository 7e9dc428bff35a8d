"""The fused Triton centroid argmax against its float32 torch reference.

On CUDA: both paths forced and the dispatcher, float32 and bfloat16, T from 1 to 256, exact
ties, suppressed tokens, CUDA-graph capture, a small and the real E2B/E4B configuration.
On CPU: the same kernel logic at small sizes through Triton's interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before triton is imported), plus the non-CUDA fallback.

What "equal" means (``_assert_tokens``): the reference computes in float32 from the same
(e.g. bfloat16) values. The kernels sum in another order, so a token must equal the reference
token wherever the reference's top-2 logit margin and its top-k / next centroid score margin
both exceed a small tolerance; elsewhere the chosen token must be an allowed candidate whose
reference logit is within the tolerance of the maximum.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from gemma4_spec.ops import centroid_argmax_triton as triton_ops
from gemma4_spec.ops.centroid_argmax import CentroidMask, centroid_argmax
from gemma4_spec.ops.centroid_argmax_triton import (
    HAS_TRITON,
    _state_for,
    centroid_argmax_fp32_reference,
    centroid_argmax_fused,
    largest_resident_programs,
    masked_logits_fp32_reference,
    persistent_programs,
    prepare_fused_centroid_argmax,
    programs_per_sm,
    select_centroids_ranked,
    select_centroids_reference,
)

PATHS = ("persistent", "centroid", "auto")
FORCED = PATHS[:-1]
needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both

SMALL = {"vocab": 4096, "centroids": 64, "top_k": 8, "d": 64}
REAL = {"vocab": 262144, "centroids": 2048, "top_k": 32, "d": 256}  # E2B / E4B assistants
TINY = {"vocab": 512, "centroids": 32, "top_k": 4, "d": 16}  # for the interpreter
# Neither C nor V / C nor d a power of two; top_k * V / C not a multiple of the programs.
ODD = {"vocab": 480, "centroids": 24, "top_k": 5, "d": 20}


def _make(
    vocab: int,
    centroids: int,
    top_k: int,
    d: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    suppressed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CentroidMask]:
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, d, generator=gen).to(device, dtype)
    centroid_w = torch.randn(centroids, d, generator=gen).to(device, dtype)
    ordering = torch.randperm(vocab, generator=gen).to(device)
    return lm_head, CentroidMask(centroid_w, ordering, top_k, suppressed)


def _hidden(num_tokens: int, d: int, dtype: torch.dtype, device: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, d, generator=gen).to(device, dtype)


def _assert_tokens(
    got: torch.Tensor,
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    mask: CentroidMask,
    tol: float = 1e-4,
    min_strict: float = 0.8,
) -> None:
    assert got.dtype == torch.int64 and got.shape == (hidden.shape[0],)
    want = centroid_argmax_fp32_reference(hidden, lm_head, mask)
    logits = masked_logits_fp32_reference(hidden, lm_head, mask)
    scores = hidden.float() @ mask.centroids_weight.float().t()
    top = scores.topk(min(mask.top_k + 1, scores.shape[1]), dim=1).values
    scale = 1.0 + logits.amax(dim=1, keepdim=True).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    c_margin = (
        top[:, mask.top_k - 1] - top[:, mask.top_k]
        if mask.top_k < scores.shape[1]
        else torch.full_like(top[:, 0], float("inf"))
    )
    two = logits.topk(2, dim=1).values
    l_margin = (two[:, 0] - two[:, 1]).nan_to_num(0.0) / scale[:, 0]
    strict = (c_margin > tol * (1.0 + top[:, 0].abs())) & (l_margin > tol)
    # Most rows must be checked exactly, or this helper proves little (with a handful of rows,
    # all but one: a single near-tie row of three is chance, not a weak check).
    rows = strict.numel()
    need = min(math.ceil(min_strict * rows), max(rows - 1, 1))
    assert int(strict.sum()) >= need, f"{int(strict.sum())} of {rows} rows clear of near-ties"
    bad = strict & (got != want)
    assert not bad.any(), f"rows {bad.nonzero().flatten().tolist()}: {got[bad]} vs {want[bad]}"
    clear_sel = c_margin > tol * (1.0 + top[:, 0].abs())
    chosen = logits.gather(1, got[:, None]).squeeze(1)
    near = clear_sel & ~strict
    assert torch.isfinite(chosen[near]).all()
    assert ((logits.amax(dim=1) - chosen)[near] <= tol * scale[near, 0]).all()
    if mask.has_suppressed():
        assert mask.suppressed is not None
        assert not torch.isin(got, mask.suppressed.to(got.device)).any()


def _check_random(cfg: dict, dtype: torch.dtype, device: str, num_tokens: int, path: str):
    lm_head, mask = _make(**cfg, dtype=dtype, device=device, seed=num_tokens)
    hidden = _hidden(num_tokens, cfg["d"], dtype, device, seed=100 + num_tokens)
    got = centroid_argmax_fused(mask, hidden, lm_head, path=path)
    _assert_tokens(got, hidden, lm_head, mask)


def _check_ties(cfg: dict, dtype: torch.dtype, device: str, num_tokens: int, path: str):
    """Exact ties from duplicated lm_head rows: the smallest token id must win."""
    lm_head, mask = _make(**cfg, dtype=dtype, device=device, seed=7)
    hidden = _hidden(num_tokens, cfg["d"], dtype, device, seed=8)
    want = centroid_argmax_fp32_reference(hidden, lm_head, mask)
    scores = hidden.float() @ mask.centroids_weight.float().t()
    selected = select_centroids_reference(scores, mask.top_k)[0].nonzero().flatten()
    cand = mask.token_ordering.view(mask.centroids_weight.shape[0], -1)[selected].flatten()[None]
    # Row 0: copy the winner's row onto a smaller candidate id (it must now win) and onto a
    # larger one (it must not); when T > 1, other rows may be affected and are checked too.
    winner = int(want[0])
    smaller = cand[0][cand[0] < winner]
    larger = cand[0][cand[0] > winner]
    assert smaller.numel() > 0 and larger.numel() > 0
    lo, hi = int(smaller.min()), int(larger.max())
    lm_head[lo] = lm_head[winner]
    lm_head[hi] = lm_head[winner]
    got = centroid_argmax_fused(mask, hidden, lm_head, path=path)
    assert int(got[0]) == lo, (int(got[0]), lo, winner, hi)
    want = centroid_argmax_fp32_reference(hidden, lm_head, mask)
    assert int(want[0]) == lo
    _assert_tokens(got, hidden, lm_head, mask, min_strict=0.0)


def _check_suppressed(cfg: dict, dtype: torch.dtype, device: str, num_tokens: int, path: str):
    lm_head, mask = _make(**cfg, dtype=dtype, device=device, seed=11)
    hidden = _hidden(num_tokens, cfg["d"], dtype, device, seed=12)
    first = centroid_argmax_fp32_reference(hidden, lm_head, mask)
    suppressed = first.unique()
    mask = CentroidMask(mask.centroids_weight, mask.token_ordering, mask.top_k, suppressed)
    got = centroid_argmax_fused(mask, hidden, lm_head, path=path)
    assert not torch.isin(got, suppressed).any()
    _assert_tokens(got, hidden, lm_head, mask)


def _check_all_suppressed(cfg: dict, dtype: torch.dtype, device: str, path: str) -> None:
    """A token whose every candidate is suppressed gets id 0, like argmax of all -inf."""
    lm_head, mask = _make(**cfg, dtype=dtype, device=device, seed=13)
    hidden = _hidden(2, cfg["d"], dtype, device, seed=14)
    scores = hidden[:1].float() @ mask.centroids_weight.float().t()
    chosen = select_centroids_reference(scores, mask.top_k)[0].nonzero().flatten()
    clusters = mask.token_ordering.view(mask.centroids_weight.shape[0], -1)
    suppressed = clusters[chosen].flatten()
    mask = CentroidMask(mask.centroids_weight, mask.token_ordering, mask.top_k, suppressed)
    got = centroid_argmax_fused(mask, hidden, lm_head, path=path)
    assert int(got[0]) == 0 == int(centroid_argmax_fp32_reference(hidden, lm_head, mask)[0])
    assert int(got[1]) == int(centroid_argmax_fp32_reference(hidden, lm_head, mask)[1])


# ------------------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 16, 31, 64, 100, 256])
def test_small_config_matches_reference(num_tokens: int, dtype: torch.dtype, path: str) -> None:
    _check_random(SMALL, dtype, "cuda", num_tokens, path)


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 16, 64, 256])
def test_real_dims_match_reference(num_tokens: int, dtype: torch.dtype, path: str) -> None:
    _check_random(REAL, dtype, "cuda", num_tokens, path)


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [SMALL, REAL], ids=["small", "real"])
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_ties_go_to_smallest_id(num_tokens: int, cfg: dict, dtype: torch.dtype, path: str):
    _check_ties(cfg, dtype, "cuda", num_tokens, path)


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [SMALL, REAL], ids=["small", "real"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_suppressed_never_drafted(num_tokens: int, cfg: dict, dtype: torch.dtype, path: str):
    _check_suppressed(cfg, dtype, "cuda", num_tokens, path)


@needs_cuda
@pytest.mark.parametrize("path", FORCED)
@pytest.mark.parametrize("cfg", [SMALL, REAL], ids=["small", "real"])
def test_all_candidates_suppressed_gives_zero(cfg: dict, path: str) -> None:
    _check_all_suppressed(cfg, torch.float32, "cuda", path)


@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 16, 64, 256])
def test_cuda_graph_replay(num_tokens: int, path: str) -> None:
    """Replays with fresh inputs: the self-resetting counters (and the persistent kernel's
    grid barriers) must start clean each time."""
    lm_head, mask = _make(**REAL, dtype=torch.bfloat16, device="cuda", seed=21)
    static_h = _hidden(num_tokens, REAL["d"], torch.bfloat16, "cuda", seed=22)
    centroid_argmax_fused(mask, static_h, lm_head, path=path)  # warm-up: compile + prepare
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        centroid_argmax_fused(mask, static_h, lm_head, path=path)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = centroid_argmax_fused(mask, static_h, lm_head, path=path)
    for seed in (23, 24, 25):
        fresh = _hidden(num_tokens, REAL["d"], torch.bfloat16, "cuda", seed=seed)
        static_h.copy_(fresh)
        graph.replay()
        _assert_tokens(static_out.clone(), fresh, lm_head, mask)
    torch.cuda.synchronize()
    assert not _state_for(mask, REAL["vocab"]).counters.any()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 8, 16, 32])
def test_persistent_programs_per_token(num_tokens: int, dtype: torch.dtype) -> None:
    """Where the occupancy sizing changes P: the persistent path (forced) gives the
    reference's tokens, directly and replayed in a CUDA graph, and leaves its counters at 0."""
    lm_head, mask = _make(**REAL, dtype=dtype, device="cuda", seed=81)
    hidden = _hidden(num_tokens, REAL["d"], dtype, "cuda", seed=82 + num_tokens)
    progs = persistent_programs(mask, hidden, lm_head)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert progs == 0 or (progs & (progs - 1) == 0 and num_tokens * progs <= 32 * sms)
    if dtype == torch.bfloat16 and num_tokens < triton_ops.CENTROID_MIN_TOKENS:
        # Where the dispatcher sends real drafts to it, the persistent kernel must fit (with
        # P = 0 a forced "persistent" quietly runs the centroid-major path instead).
        assert progs > 0
    got = centroid_argmax_fused(mask, hidden, lm_head, path="persistent")
    _assert_tokens(got, hidden, lm_head, mask)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = centroid_argmax_fused(mask, hidden, lm_head, path="persistent")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, got)
    assert not _state_for(mask, REAL["vocab"]).counters.any()


@needs_cuda
def test_centroid_score_ties_go_to_smallest_index() -> None:
    _check_score_ties("cuda")


@needs_cuda
@pytest.mark.parametrize("path", FORCED)
@pytest.mark.parametrize("cfg", [ODD, REAL], ids=["odd", "real"])
def test_all_scores_and_logits_equal(cfg: dict, path: str) -> None:
    _check_all_equal(cfg, torch.bfloat16, "cuda", path)
    _check_random(ODD, torch.bfloat16, "cuda", 3, path)


@needs_cuda
def test_rank_select_matches_stable_sort() -> None:
    _check_rank_select("cuda")


@needs_cuda
def test_counters_reset_after_every_path() -> None:
    _check_counters_reset("cuda")


@needs_cuda
def test_unprepared_capacity_growth_outside_capture() -> None:
    # More tokens than the default counter capacity (1024): the state grows, results hold.
    lm_head, mask = _make(**SMALL, dtype=torch.float32, device="cuda", seed=31)
    hidden = _hidden(1500, SMALL["d"], torch.float32, "cuda", seed=32)
    for path in PATHS:
        _assert_tokens(centroid_argmax_fused(mask, hidden, lm_head, path=path), hidden,
                       lm_head, mask)  # fmt: skip


@needs_cuda
def test_graph_outlives_capacity_growth_and_cache_eviction() -> None:
    """A graph captured over a mask's state keeps reading that state's memory: neither a later
    batch past the counters' capacity nor the cache dropping the mask's entry may free it (a
    freed tensor goes to the next allocation: vLLM's in-tree drafter hit an illegal memory
    access replaying its centroid graphs over a freed temporary, vllm#43909)."""
    lm_head, mask = _make(**SMALL, dtype=torch.float32, device="cuda", seed=91)
    static_h = _hidden(4, SMALL["d"], torch.float32, "cuda", seed=92)
    centroid_argmax_fused(mask, static_h, lm_head, path="centroid")  # compile + prepare
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = centroid_argmax_fused(mask, static_h, lm_head, path="centroid")
    # Outgrow the counters, then evict the entry with other masks' states.
    big = _hidden(1500, SMALL["d"], torch.float32, "cuda", seed=93)
    centroid_argmax_fused(mask, big, lm_head, path="centroid")
    for seed in range(94, 104):
        other_head, other = _make(**SMALL, dtype=torch.float32, device="cuda", seed=seed)
        centroid_argmax_fused(other, static_h, other_head, path="centroid")
    # Whatever was freed is handed out again, filled with junk.
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 16,), 7, dtype=torch.int32, device="cuda") for _ in range(64)]
    for seed in (105, 106):
        fresh = _hidden(4, SMALL["d"], torch.float32, "cuda", seed=seed)
        static_h.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        _assert_tokens(static_out.clone(), fresh, lm_head, mask)
    del junk


# -------------------------------------------------------------------------------------- CPU


def test_counters_outgrown_are_kept_for_graphs_captured_before() -> None:
    lm_head, mask = _make(**TINY, dtype=torch.float32, device="cpu")
    state = prepare_fused_centroid_argmax(mask, TINY["vocab"], capacity=4)
    first = weakref.ref(state.counters)
    state.ensure_capacity(10)
    gc.collect()
    assert state.counters.shape[1] >= 10
    assert first() is not None and first() is not state.counters


def test_states_seen_in_a_capture_outlive_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # Capture is told, not run: CPU tensors here (the CUDA test above captures for real).
    monkeypatch.setattr(triton_ops, "_CAPTURED_STATES", [])
    monkeypatch.setattr(triton_ops, "_STATE_CACHE", {})
    lm_head, mask = _make(**TINY, dtype=torch.float32, device="cpu", seed=1)
    _state_for(mask, TINY["vocab"])  # prepared outside the capture
    monkeypatch.setattr(triton_ops, "_capturing", lambda device: True)
    captured = weakref.ref(_state_for(mask, TINY["vocab"]))
    monkeypatch.setattr(triton_ops, "_capturing", lambda device: False)
    for seed in range(2, 12):  # more masks than the cache holds: it is cleared
        _state_for(_make(**TINY, dtype=torch.float32, device="cpu", seed=seed)[1], TINY["vocab"])
    gc.collect()
    state = captured()
    assert state is not None and state.captured
    assert all(state is not entry for _, entry in triton_ops._STATE_CACHE.values())
    assert triton_ops._CAPTURED_STATES == [state]


def test_cpu_falls_back_to_torch_path() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("under the interpreter the kernels run on CPU instead")
    lm_head, mask = _make(**TINY, dtype=torch.float32, device="cpu")
    hidden = _hidden(5, TINY["d"], torch.float32, "cpu")
    got = centroid_argmax_fused(mask, hidden, lm_head)
    assert torch.equal(got, centroid_argmax(hidden, lm_head, mask))
    _assert_tokens(got, hidden, lm_head, mask)


def test_threshold_env_variable_keeps_its_old_name() -> None:
    """CENTROID_MIN_TOKENS (formerly DENSE_MIN_TOKENS) still reads the old env variable."""
    code = "from gemma4_spec.ops import centroid_argmax_triton as m; print(m.CENTROID_MIN_TOKENS)"
    env = dict(os.environ, GEMMA4_SPEC_DENSE_MIN_TOKENS="7")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["7"]


def test_programs_per_sm_hand_computed() -> None:
    """CUDA's occupancy rules on an H100 / H200 SM (65536 registers, 4 quarters, allocated
    per warp in units of 256; 228 KiB of shared, 1 KiB reserved per block; 2048 threads; 32
    blocks), by hand."""
    assert programs_per_sm(32, 0, 4) == 16  # threads: 2048 / 128; regs: 64 warps
    assert programs_per_sm(16, 0, 1) == 32  # the block limit
    assert programs_per_sm(128, 0, 8) == 2  # 4096 regs a warp: 4 per quarter, 16 warps
    assert programs_per_sm(162, 0, 4) == 3  # 5184 -> 5376 a warp: 3 per quarter, 12 warps
    assert programs_per_sm(255, 0, 8) == 1  # 8160 -> 8192 a warp: 2 per quarter, 8 warps
    assert programs_per_sm(80, 0, 1) == 24  # 2560 a warp: 6 per quarter (not 65536 // 2560)
    assert programs_per_sm(40, 0, 4) == 12  # 1280 a warp: 12 per quarter, 48 warps
    assert programs_per_sm(32, 100 * 1024, 4) == 2  # (102400 + 1024) per block of 233472
    assert programs_per_sm(32, 57 * 1024 - 1024, 4) == 4  # 4 x 57 KiB: exactly full
    assert programs_per_sm(32, 57 * 1024 - 1023, 4) == 3  # one byte more: 128 more a block
    assert programs_per_sm(32, 228 * 1024, 4) == 0  # more than one block may have
    assert programs_per_sm(0, 0, 32) == 2  # no registers counted: threads alone


def test_largest_resident_programs() -> None:
    """The largest power of two P in [least, most] with T * P <= SMs x resident(P)."""
    one = lambda p: 1  # noqa: E731 - the old rule: one program per SM
    assert [largest_resident_programs(t, 132, 128, 1, one) for t in (1, 2, 4, 8, 16)] == [
        128, 64, 32, 16, 8,
    ]  # fmt: skip
    # Registers grow as P shrinks (more centroids and rows per program): 3, then 1 per SM.
    regs = lambda p: 3 if p >= 128 else 1  # noqa: E731
    assert [largest_resident_programs(t, 132, 128, 8, regs) for t in (1, 2, 3, 4, 16)] == [
        128, 128, 128, 32, 8,
    ]  # fmt: skip
    assert largest_resident_programs(17, 132, 128, 8, regs) == 0  # below the floor
    assert largest_resident_programs(40, 132, 128, 1, regs) == 2
    assert largest_resident_programs(133, 132, 128, 1, one) == 0
    assert largest_resident_programs(1, 16, 24, 1, one) == 16  # at most C (24 here)
    asked: list[int] = []
    largest_resident_programs(4, 132, 128, 8, lambda p: asked.append(p) or 1)
    assert asked == [128, 64, 32]  # from the largest down, stopping at the first that fits


# The interpreter checks run as two concurrent subprocesses, to keep CPU CI short.
INTERPRETER_GROUPS = ("paths", "special")


def _interpreter_checks(group: str = "paths") -> None:
    """Small-size kernel checks, run on CPU tensors with TRITON_INTERPRET=1: random, tied and
    suppressed tokens through each path ("paths"), then the edge cases ("special")."""
    if group == "special":
        _interpreter_special_checks()
        return
    # The persistent kernel itself runs below up to 16 tokens (one "SM" a program under the
    # interpreter); past that a forced "persistent" runs the centroid-major path.
    lm_head, mask = _make(**TINY, dtype=torch.float32, device="cpu", seed=91)
    for num_tokens, fits in ((1, True), (3, True), (5, True), (16, True), (17, False)):
        hidden = _hidden(num_tokens, TINY["d"], torch.float32, "cpu", seed=92)
        assert (persistent_programs(mask, hidden, lm_head) > 0) is fits, num_tokens
    for dtype in (torch.float32, torch.bfloat16):
        for path in PATHS:
            if path == "auto" and dtype != torch.float32:
                continue  # the dispatcher only picks one of the forced paths
            for num_tokens in (1, 3, 5):
                _check_random(TINY, dtype, "cpu", num_tokens, path)
            _check_ties(TINY, dtype, "cpu", 2, path)
            _check_suppressed(TINY, dtype, "cpu", 3, path)
        for path in FORCED:
            _check_all_suppressed(TINY, dtype, "cpu", path)
    # A block of 16 tokens through tl.dot; more tokens than the persistent grid holds.
    for path in FORCED:
        _check_random(TINY, torch.float32, "cpu", 17, path)
    # Several row blocks per program (V / C > 128) and several token blocks.
    long_rows = {"vocab": 2048, "centroids": 8, "top_k": 3, "d": 32}
    for path in FORCED:
        _check_random(long_rows, torch.float32, "cpu", 70, path)


def _interpreter_special_checks() -> None:
    _check_score_ties("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for path in FORCED:
            _check_random(ODD, dtype, "cpu", 3, path)
            _check_all_equal(ODD, dtype, "cpu", path)
            _check_all_suppressed(ODD, dtype, "cpu", path)
    _check_random(ODD, torch.float32, "cpu", 40, "centroid")  # several picks per centroid
    _check_rank_select("cpu")
    _check_counters_reset("cpu")


def _check_counters_reset(device: str) -> None:
    """Every "last program" and grid-barrier counter is back at zero after each path, so the
    next call (or graph replay) starts clean. Under the interpreter, 9 to 16 tokens give one
    persistent program per token: the single launch with its (then trivial) barriers."""
    lm_head, mask = _make(**TINY, dtype=torch.float32, device=device, seed=61)
    for num_tokens in (1, 12):
        hidden = _hidden(num_tokens, TINY["d"], torch.float32, device, seed=62 + num_tokens)
        for path in FORCED:
            first = centroid_argmax_fused(mask, hidden, lm_head, path=path)
            _assert_tokens(first, hidden, lm_head, mask)
            assert torch.equal(centroid_argmax_fused(mask, hidden, lm_head, path=path), first)
            counters = _state_for(mask, TINY["vocab"]).counters
            assert not counters.any(), (path, num_tokens, counters.nonzero().tolist())


def _check_all_equal(cfg: dict, dtype: torch.dtype, device: str, path: str) -> None:
    """A zero hidden state: every centroid score and every logit ties (all candidates are
    ranked together), so the smallest centroids and then the smallest token id win."""
    lm_head, mask = _make(**cfg, dtype=dtype, device=device, seed=41)
    hidden = torch.zeros(2, cfg["d"], dtype=dtype, device=device)
    got = centroid_argmax_fused(mask, hidden, lm_head, path=path)
    want = centroid_argmax_fp32_reference(hidden, lm_head, mask)
    assert torch.equal(got, want), (path, got, want)


def _check_rank_select(device: str) -> None:
    """The rank top-k alone against the stable-sort reference, on scores with many exact ties
    (rounded hidden states and centroid weights), including more candidates than one block."""
    gen = torch.Generator().manual_seed(51)
    for num_centroids, top_k in ((300, 7), (64, 64), (256, 1)):
        cw = torch.randint(-2, 3, (num_centroids, 8), generator=gen).float().to(device)
        hidden = torch.randint(-1, 2, (5, 8), generator=gen).float().to(device)
        vocab = num_centroids * 2
        mask = CentroidMask(cw, torch.randperm(vocab, generator=gen).to(device), top_k)
        state = prepare_fused_centroid_argmax(mask, vocab)
        sel, count, picks, picked = select_centroids_ranked(state, hidden, cw)
        want = select_centroids_reference(hidden @ cw.t(), top_k)
        got = torch.zeros_like(want)
        got.scatter_(1, sel.long(), True)
        assert torch.equal(got, want), num_centroids
        # sel is in rank order: scores descending, ties by centroid index.
        order = torch.sort(hidden @ cw.t(), dim=1, descending=True, stable=True).indices
        assert torch.equal(sel.long(), order[:, :top_k])
        assert torch.equal(count.long(), want.sum(0))
        # The list of picked centroids: each centroid some token picked, once.
        listed = picked[1 : 1 + int(picked[0])].long()
        assert torch.equal(listed.sort().values, count.nonzero().flatten())
        for c in range(num_centroids):
            entries = picks[c, : int(count[c])].long()
            tokens, ranks = entries // top_k, entries % top_k
            assert torch.equal(sel[tokens, ranks].long(), torch.full_like(tokens, c))


def _check_score_ties(device: str) -> None:
    """Equal centroid scores across the top-k boundary: the smallest centroid indices win."""
    lm_head, mask = _make(**TINY, dtype=torch.float32, device=device, seed=3)
    hidden = _hidden(4, TINY["d"], torch.float32, device, seed=5)
    scores = hidden[:1].float() @ mask.centroids_weight.float().t()
    # Copy row 0's top-k-th centroid onto four others: ties straddle the boundary for token 0.
    kth = int(scores[0].sort(descending=True, stable=True).indices[mask.top_k - 1])
    cw = mask.centroids_weight.clone()
    others = [c for c in range(cw.shape[0]) if c != kth][:: max(1, cw.shape[0] // 4)][:4]
    cw[others] = cw[kth].clone()
    mask = CentroidMask(cw, mask.token_ordering, mask.top_k)
    want = centroid_argmax_fp32_reference(hidden, lm_head, mask)
    for path in FORCED:
        got = centroid_argmax_fused(mask, hidden, lm_head, path=path)
        assert torch.equal(got, want), (path, got, want)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU CI only (the CUDA tests cover the kernels there)"
)
def test_kernels_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    procs = {
        group: subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import test_centroid_argmax_cuda as t; t._interpreter_checks({group!r})",
            ],
            cwd=Path(__file__).parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for group in INTERPRETER_GROUPS
    }
    for group, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{group}:\n{out}"
