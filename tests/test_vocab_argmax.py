"""The full-vocabulary greedy argmax (``ops/vocab_argmax*.py``) against its torch reference,
and the assistant model's ``get_top_tokens`` against ``compute_logits(...).argmax(-1)``.

On CPU the kernel runs at small sizes under Triton's interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before triton is imported). On CUDA: the same checks, and
the real 26B-A4B / 31B assistant head (H=1024, V=262144) incl. CUDA-graph capture and replay.

What "equal" means (``_assert_tokens``): the reference sums in float32 in torch's order, the
kernel in the MMA's. A token must equal the reference's wherever the reference's top-2 logit
margin exceeds a small tolerance; elsewhere its reference logit must be within the tolerance of
the maximum. Exact ties are built from integer-valued data, where every sum is exact and the
smallest id must win.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.vocab_argmax import vocab_argmax_reference
from gemma4_spec.ops.vocab_argmax_triton import (
    _STATE_CACHE,
    VocabArgmaxConfig,
    _state_for,
    prepare_vocab_argmax,
    vocab_argmax,
    vocab_argmax_config,
)

needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both
REAL = {"vocab": 262144, "hidden": 1024}  # the 26B-A4B and 31B assistants' lm_head
# Neither V nor H a multiple of the tiles (128 rows, 64 hidden): masked edges everywhere.
ODD = {"vocab": 1000, "hidden": 40}
TINY = {"vocab": 512, "hidden": 64}


def _make(
    vocab: int, hidden: int, num_tokens: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, hidden, generator=gen).to(device, dtype)
    h = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    return h, lm_head


def _assert_tokens(
    got: torch.Tensor,
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    suppressed: torch.Tensor | None = None,
    tol: float = 1e-4,
    min_strict: float = 0.8,
) -> None:
    assert got.dtype == torch.int64 and got.shape == (hidden.shape[0],)
    got = got.cpu()
    want = vocab_argmax_reference(hidden, lm_head, suppressed).cpu()
    logits = (hidden.float() @ lm_head.float().t()).cpu()
    if suppressed is not None:
        logits[:, suppressed.cpu()] = float("-inf")
    top = logits.topk(2, dim=1).values
    scale = 1.0 + top[:, 0].abs()
    strict = (top[:, 0] - top[:, 1]) > tol * scale
    rows = strict.numel()
    need = min(math.ceil(min_strict * rows), max(rows - 1, 1))
    assert int(strict.sum()) >= need, f"{int(strict.sum())} of {rows} rows clear of near-ties"
    bad = strict & (got != want)
    assert not bad.any(), f"rows {bad.nonzero().flatten().tolist()}: {got[bad]} vs {want[bad]}"
    chosen = logits.gather(1, got[:, None]).squeeze(1)
    assert ((top[:, 0] - chosen) <= tol * scale).all()
    if suppressed is not None:
        assert not torch.isin(got, suppressed.cpu()).any()


# ------------------------------------------------------------------------- the reference


def test_reference_hand_worked() -> None:
    lm_head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    hidden = torch.tensor([[1.0, 0.0], [0.0, -1.0], [1.0, 1.0]])
    # Row 0: ids 2 and 4 tie at 2.0, the smaller wins. Row 1: 0 and 2 and 4 tie at 0.0.
    # Row 2: 2, 3 and 4 tie at 2.0.
    assert vocab_argmax_reference(hidden, lm_head).tolist() == [2, 0, 2]
    # Suppressed: the next best, ties again to the smaller id.
    assert vocab_argmax_reference(hidden, lm_head, torch.tensor([2])).tolist() == [4, 0, 3]
    # Everything suppressed: 0, what argmax of an all -inf row gives.
    every = torch.arange(5)
    assert vocab_argmax_reference(hidden, lm_head, every).tolist() == [0, 0, 0]


def test_reference_ignores_softcapping() -> None:
    """Soft-capping is increasing: the capped logits have the same argmax (margins clear)."""
    hidden, lm_head = _make(**TINY, num_tokens=33, dtype=torch.float32, device="cpu", seed=3)
    logits = hidden @ lm_head.t()
    capped = torch.tanh(logits / 30.0) * 30.0
    assert torch.equal(vocab_argmax_reference(hidden, lm_head), capped.argmax(-1))


def test_cpu_falls_back_to_reference() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("under the interpreter the kernel runs on CPU instead")
    hidden, lm_head = _make(**ODD, num_tokens=6, dtype=torch.float32, device="cpu")
    suppressed = torch.tensor([3, 17])
    assert torch.equal(
        vocab_argmax(hidden, lm_head, suppressed),
        vocab_argmax_reference(hidden, lm_head, suppressed),
    )


def test_outgrown_counters_are_kept_for_captured_graphs() -> None:
    # A graph captured before a larger batch grew the counters still reads and resets the old
    # tensor at every replay: it must stay allocated (the centroid kernels keep theirs too).
    state = prepare_vocab_argmax(100, torch.device("cpu"), capacity=2)
    old = state.counters
    state.ensure_capacity(2)
    assert state.counters is old and state.retired == []
    state.ensure_capacity(5)
    assert state.counters.shape == (5,) and not state.counters.any()
    assert len(state.retired) == 1 and state.retired[0] is old


# ---------------------------------------------------------------------------- the kernel


def _check_random(vocab: int, hidden: int, num_tokens: int, dtype: torch.dtype, device: str,
                  config: VocabArgmaxConfig | None = None) -> None:  # fmt: skip
    h, lm_head = _make(vocab, hidden, num_tokens, dtype, device, seed=num_tokens)
    _assert_tokens(vocab_argmax(h, lm_head, config=config), h, lm_head)


def _integer_case(
    vocab: int, hidden: int, num_tokens: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Small integers: every product and float32 sum is exact, in bfloat16 too."""
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randint(-3, 4, (vocab, hidden), generator=gen).to(device, dtype)
    h = torch.randint(-2, 3, (num_tokens, hidden), generator=gen).to(device, dtype)
    return h, lm_head


def _check_ties(vocab: int, hidden: int, num_tokens: int, dtype: torch.dtype, device: str,
                config: VocabArgmaxConfig | None = None) -> None:  # fmt: skip
    """Exact ties go to the smallest id: copies of the winner's row at a smaller id (in
    another tile, and the first of the vocabulary) and at larger ids (the last row too), and
    data with many natural ties."""
    h, lm_head = _integer_case(vocab, hidden, num_tokens, dtype, device, seed=5)
    assert torch.equal(vocab_argmax(h, lm_head, config=config).cpu(),
                       vocab_argmax_reference(h, lm_head).cpu())  # fmt: skip
    winner = int(vocab_argmax_reference(h, lm_head)[0])
    rows = {0, winner // 2, vocab - 1, min(vocab - 1, winner + 129)} - {winner}
    for row in rows:
        lm_head[row] = lm_head[winner]
    want = vocab_argmax_reference(h, lm_head)
    assert int(want[0]) == min(rows | {winner})
    got = vocab_argmax(h, lm_head, config=config)
    assert torch.equal(got.cpu(), want.cpu()), (got, want)
    # All-zero hidden states: every logit is 0, token 0 wins.
    zeros = torch.zeros_like(h)
    assert not vocab_argmax(zeros, lm_head, config=config).any()


def _check_suppressed(vocab: int, hidden: int, num_tokens: int, dtype: torch.dtype, device: str,
                      config: VocabArgmaxConfig | None = None) -> None:  # fmt: skip
    """The winners suppressed: the next best is drafted, ties among equals to the smallest
    id; everything suppressed: 0."""
    h, lm_head = _integer_case(vocab, hidden, num_tokens, dtype, device, seed=9)
    first = vocab_argmax_reference(h, lm_head)
    suppressed = torch.cat([first.unique(), torch.tensor([vocab - 1], device=first.device)])
    want = vocab_argmax_reference(h, lm_head, suppressed)
    got = vocab_argmax(h, lm_head, suppressed, config=config)
    assert torch.equal(got.cpu(), want.cpu()), (got, want)
    assert not torch.isin(got, suppressed).any()
    every = torch.arange(vocab, device=h.device)
    assert not vocab_argmax(h, lm_head, every, config=config).any()
    h, lm_head = _make(vocab, hidden, num_tokens, dtype, device, seed=10)
    suppressed = vocab_argmax_reference(h, lm_head).unique()
    _assert_tokens(vocab_argmax(h, lm_head, suppressed, config=config), h, lm_head, suppressed)


# Forced configurations: several token blocks (T > BLOCK_T), one split for the whole
# vocabulary, more splits asked than there are tiles, small tiles, odd tile counts per split.
CONFIGS = (
    VocabArgmaxConfig(16, 16, 16, 5, 4, 2),
    VocabArgmaxConfig(16, 128, 64, 1, 4, 3),
    VocabArgmaxConfig(32, 64, 32, 1000, 4, 3),
)


def _check_kernel_against_reference(device: str) -> None:
    assert triton_usable(torch.device(device)), "no kernel would run: reference against itself"
    for dtype in (torch.float32, torch.bfloat16):
        for cfg in (TINY, ODD):
            for num_tokens in (1, 5, 16, 17, 40):
                _check_random(cfg["vocab"], cfg["hidden"], num_tokens, dtype, device)
            _check_ties(cfg["vocab"], cfg["hidden"], 3, dtype, device)
            _check_suppressed(cfg["vocab"], cfg["hidden"], 4, dtype, device)
        for config in CONFIGS:
            _check_random(ODD["vocab"], ODD["hidden"], 37, dtype, device, config)
            _check_ties(ODD["vocab"], ODD["hidden"], 20, dtype, device, config)
            _check_suppressed(ODD["vocab"], ODD["hidden"], 3, dtype, device, config)
    # Every token block's counter is back at zero after each call: the next starts clean.
    for _, state in _STATE_CACHE.values():
        assert not state.counters.any(), state.counters.nonzero().tolist()


@needs_cuda
def test_kernel_matches_reference_cuda_small() -> None:
    _check_kernel_against_reference("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA tests cover it)")
def test_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_vocab_argmax", "_check_kernel_against_reference")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 16, 31, 64, 100, 128, 256, 512])
def test_real_dims_match_reference(num_tokens: int, dtype: torch.dtype) -> None:
    _check_random(REAL["vocab"], REAL["hidden"], num_tokens, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 200])
def test_real_dims_ties_and_suppressed(num_tokens: int) -> None:
    _check_ties(REAL["vocab"], REAL["hidden"], num_tokens, torch.bfloat16, "cuda")
    _check_suppressed(REAL["vocab"], REAL["hidden"], num_tokens, torch.bfloat16, "cuda")


@needs_cuda
@pytest.mark.parametrize("suppress", [False, True], ids=["plain", "suppressed"])
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 256, 512])
def test_cuda_graph_replay(num_tokens: int, suppress: bool) -> None:
    """Captured once, replayed with fresh hidden states: right tokens every time, and the
    self-resetting counters at zero afterwards."""
    static_h, lm_head = _make(**REAL, num_tokens=num_tokens, dtype=torch.bfloat16, device="cuda")
    suppressed = vocab_argmax_reference(static_h, lm_head).unique() if suppress else None
    vocab_argmax(static_h, lm_head, suppressed)  # eager first: compiles, builds the state
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = vocab_argmax(static_h, lm_head, suppressed)
    for seed in (31, 32, 33):
        gen = torch.Generator().manual_seed(seed)
        fresh = torch.randn(num_tokens, REAL["hidden"], generator=gen).to("cuda", torch.bfloat16)
        static_h.copy_(fresh)
        graph.replay()
        _assert_tokens(static_out.clone(), fresh, lm_head, suppressed)
    torch.cuda.synchronize()
    assert not _state_for(REAL["vocab"], static_h.device, suppressed).counters.any()


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 128, 512])
def test_config_fits_h200(num_tokens: int) -> None:
    """The launch sizes at the real dims: every split has tiles, one wave of programs."""
    cfg = vocab_argmax_config(num_tokens, REAL["vocab"], REAL["hidden"], torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = math.ceil(num_tokens / cfg.block_t)
    assert cfg.block_t >= min(num_tokens, 128) and blocks * cfg.splits <= 2 * sms


# ---------------------------------------------------------------------- the model's wiring


def test_model_top_tokens_equal_argmax_of_logits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A full-vocabulary assistant (no centroids) with soft-capping and suppressed tokens:
    ``get_top_tokens`` (this kernel, or its reference on CPU) gives ``compute_logits``'s
    argmax, and never a suppressed token."""
    pytest.importorskip("vllm")
    from test_model_vs_transformers import _assistant_module

    from gemma4_spec.testing.tiny import build_tiny_pair

    target_dir, assistant_dir = build_tiny_pair(tmp_path / "pair", centroids=False)
    config_path = assistant_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    config_path.write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, config["text_config"]["hidden_size"], generator=gen)
    generation_path = assistant_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    # The greedy tokens of the first rows, and the last id of the vocabulary.
    with torch.no_grad():
        (tmp_path / "plain").mkdir()
        _, plain = _assistant_module(target_dir, assistant_dir, tmp_path / "plain")
        favourites = plain.get_top_tokens(hidden)[:8].unique().tolist()
    generation["suppress_tokens"] = favourites + [plain.vocab_size - 1]
    generation_path.write_text(json.dumps(generation))

    (tmp_path / "suppressed").mkdir()
    _, draft = _assistant_module(target_dir, assistant_dir, tmp_path / "suppressed")
    assert draft.masked_embedding is None and draft.final_logit_softcapping == 30.0
    assert draft.suppressed_tokens.numel() == len(generation["suppress_tokens"])
    with torch.no_grad():
        logits = draft.compute_logits(hidden)
        top = draft.get_top_tokens(hidden)
    # The premise: clear margins, so float32 summation order cannot decide a row.
    two = logits.topk(2, dim=-1).values
    assert ((two[:, 0] - two[:, 1]) > 1e-4).all()
    assert torch.equal(top, logits.argmax(dim=-1))
    assert not torch.isin(top, draft.suppressed_tokens).any()
    assert (top != plain.get_top_tokens(hidden))[:8].all()
