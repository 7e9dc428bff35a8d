"""``spec_decode/verify_graphs.py`` and its use in ``patch/patch_v2_sample.py``: a decode batch
(every request with its k drafts) replays its greedy verification from a graph captured at
start-up, with the step's hidden rows and index arrays copied into the graph's inputs; every
other batch takes the eager path. On CPU with a stand-in graph (what is copied where, which
batches a graph serves, what the wrapper returns and counts); on CUDA a real capture against
the same launch run eagerly. The GPU engine test runs the graphs in an engine against plain
decoding (``greedy_verify_graphed``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gemma4_spec.patch import patch_v2_sample as patch
from gemma4_spec.patch.patch_rejection_sampler import GREEDY_VERIFY_ATTR, GreedyVerifyStats
from gemma4_spec.spec_decode.verify_graphs import Captured, Persistent, VerifyGraphs
from gemma4_spec.testing.uva_ring import UvaRing

WIDTH = 3  # k = 2
HIDDEN = 4
MAX_REQS = 5


def _persistent(device: str = "cpu") -> Persistent:
    return Persistent(
        input_ids=torch.zeros(64, dtype=torch.int32, device=device),
        positions=torch.zeros(64, dtype=torch.int64, device=device),
        seq_lens=torch.zeros(8, dtype=torch.int32, device=device),
    )


def _batch(persistent: Persistent, n: int, rows: int | None = None) -> Any:
    rows = n * WIDTH if rows is None else rows
    return SimpleNamespace(
        num_reqs=n,
        logits_indices=torch.arange(rows, dtype=torch.int64).flip(0) + 1,
        cu_num_logits=torch.arange(n + 1, dtype=torch.int32) * WIDTH,
        idx_mapping=torch.arange(n, dtype=torch.int32).flip(0),
        input_ids=persistent.input_ids[: rows + 2],
        positions=persistent.positions[: rows + 2],
        seq_lens=persistent.seq_lens[:n],
        num_draft_tokens=n * (WIDTH - 1),
    )


class _Graph:
    """Stands in for a captured graph: a replay records what the inputs held."""

    def __init__(self, graphs: VerifyGraphs, n: int) -> None:
        self.graphs, self.n = graphs, n
        self.seen: Any = None

    def replay(self) -> None:
        g, rows = self.graphs, self.n * WIDTH
        self.seen = (
            g.hidden[:rows].clone(),
            g.logits_indices[:rows].clone(),
            g.cu_num_logits[: self.n + 1].clone(),
            g.idx_mapping[: self.n].clone(),
            tuple(a.clone() for a in g.arrays),
        )


def _prefill_lens() -> UvaRing:
    """A request-state array as V2 keeps its prefill lengths: a ring of buffers."""
    return UvaRing(torch.arange(MAX_REQS, dtype=torch.int32) + 100)


def _graphs(
    persistent: Persistent,
    sizes: tuple[int, ...] = (2,),
    uncapped: bool = False,
    ring: UvaRing | None = None,
) -> VerifyGraphs:
    ring = _prefill_lens() if ring is None else ring
    graphs = VerifyGraphs(
        lambda *args: None,
        persistent,
        lambda: (ring.gpu,),
        MAX_REQS,
        WIDTH,
        uncapped,
        HIDDEN,
        torch.float32,
        torch.device("cpu"),
    )
    for n in sizes:
        outputs = (torch.full((n, WIDTH), 7), torch.full((n,), 2), torch.full((n,), 1))
        graphs.graphs[n] = Captured(_Graph(graphs, n), *outputs)  # type: ignore[arg-type]
    return graphs


def test_a_decode_batch_replays_its_graph_over_its_own_rows() -> None:
    persistent = _persistent()
    graphs = _graphs(persistent)
    batch = _batch(persistent, 2)
    hidden = torch.randn(10, HIDDEN)
    sampled, num_sampled, num_rejected = graphs.run(hidden, batch)
    graph = graphs.graphs[2].graph
    rows, indices, cu, idx, _ = graph.seen  # type: ignore[attr-defined]
    assert torch.equal(rows, hidden[batch.logits_indices])
    assert torch.equal(indices, batch.logits_indices)
    assert torch.equal(cu, batch.cu_num_logits) and torch.equal(idx, batch.idx_mapping)
    assert graphs.replays == 1
    # Copies: the next replay rewrites the graph's tensors while vLLM still reads these.
    captured = graphs.graphs[2]
    for got, own in zip(
        (sampled, num_sampled, num_rejected),
        (captured.sampled, captured.num_sampled, captured.num_rejected),
        strict=True,
    ):
        assert torch.equal(got, own)
        assert got.untyped_storage().data_ptr() != own.untyped_storage().data_ptr()


def test_a_replay_reads_the_request_arrays_vllm_holds_now() -> None:
    # V2 moves a UvaBackedTensor's ``gpu`` to the next buffer of its ring at every update, so
    # the buffer current at capture holds stale values every other step: the H200's trained
    # pair lost greedy equality with plain decoding from its second pass while the graphs
    # read the prefill lengths through the pointer they baked in.
    persistent = _persistent()
    ring = _prefill_lens()
    graphs = _graphs(persistent, ring=ring)
    assert graphs.arrays[0].data_ptr() not in {b.data_ptr() for b in ring._ring}
    hidden = torch.randn(10, HIDDEN)
    for step in range(3):
        ring.np[:] = 200 + 10 * step  # new requests: new lengths, another buffer
        ring.copy_to_uva()
        graphs.run(hidden, _batch(persistent, 2))
        (seen,) = graphs.graphs[2].graph.seen[-1]  # type: ignore[attr-defined]
        assert torch.equal(seen, torch.full((MAX_REQS,), 200 + 10 * step, dtype=torch.int32))


@pytest.mark.parametrize(
    "case", ["size not captured", "short of drafts", "other buffers", "other dtype"]
)
def test_other_batches_take_the_eager_path(case: str) -> None:
    persistent = _persistent()
    graphs = _graphs(persistent)
    hidden = torch.randn(10, HIDDEN, dtype=torch.float64 if case == "other dtype" else None)
    if case == "size not captured":
        batch = _batch(persistent, 3)
    elif case == "short of drafts":
        batch = _batch(persistent, 2, rows=2 * WIDTH - 1)
    else:
        batch = _batch(_persistent() if case == "other buffers" else persistent, 2)
    assert graphs.run(hidden, batch) is None
    assert graphs.replays == 0


def _runner_module() -> Any:
    module = SimpleNamespace()

    class GPUModelRunner:
        def __init__(self, graphs: Any, cap: float | None) -> None:
            self.rejection_sampler = SimpleNamespace(sampler=SimpleNamespace(compute_nans=False))
            setattr(self.rejection_sampler, GREEDY_VERIFY_ATTR, GreedyVerifyStats())
            setattr(self.rejection_sampler, patch.VERIFY_GREEDY_TOKENS, None)
            self.speculator = SimpleNamespace(draft_logits=None)
            head = None if cap is None else patch.CappedHead(SimpleNamespace(), cap)
            setattr(self, patch.CAPPED_HEAD_ATTR, head)
            setattr(self, patch.VERIFY_GRAPHS_ATTR, graphs)

        def sample(self, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
            return "vllm's"

    module.GPUModelRunner = GPUModelRunner
    return module


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    monkeypatch.setattr(patch, "greedy_verify_applies", lambda rs, batch, draft_logits: True)
    module = _runner_module()
    patch.apply(module)  # type: ignore[arg-type]
    return module


@pytest.mark.parametrize("cap", [30.0, None])
def test_the_wrapper_returns_the_replayed_verification(wrapped: Any, cap: float | None) -> None:
    persistent = _persistent()
    runner = wrapped.GPUModelRunner(_graphs(persistent, uncapped=cap is not None), cap)
    out, num_sampled, num_rejected = runner.sample(
        torch.randn(10, HIDDEN), _batch(persistent, 2), None
    )
    assert torch.equal(out.sampled_token_ids, torch.full((2, WIDTH), 7))
    assert out.num_sampled is num_sampled and torch.equal(num_sampled, torch.full((2,), 2))
    assert out.num_rejected is num_rejected and out.logprobs_tensors is None
    stats = getattr(runner.rejection_sampler, GREEDY_VERIFY_ATTR)
    assert (stats.batches, stats.graphed) == (1, 1)
    assert stats.uncapped == (1 if cap else 0)  # a capped target's graph skipped the cap


@pytest.mark.parametrize("case", ["not greedy", "grammar", "no graph for it"])
def test_the_wrapper_leaves_other_batches_to_the_eager_paths(
    wrapped: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    persistent = _persistent()
    runner = wrapped.GPUModelRunner(_graphs(persistent), None)  # no cap: vLLM's path next
    batch = _batch(persistent, 3 if case == "no graph for it" else 2)
    if case == "not greedy":
        monkeypatch.setattr(patch, "greedy_verify_applies", lambda rs, b, d: False)
    grammar = object() if case == "grammar" else None
    assert runner.sample(torch.randn(10, HIDDEN), batch, grammar) == "vllm's"
    assert getattr(runner.rejection_sampler, GREEDY_VERIFY_ATTR).graphed == 0


def _serving_runner(**changes: Any) -> Any:
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    runner = _runner_module().GPUModelRunner(None, None)
    runner.device = torch.device("cuda")
    from vllm.config.compilation import CUDAGraphMode

    compilation = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    runner.vllm_config = SimpleNamespace(parallel_config=parallel, compilation_config=compilation)
    runner.pcp_manager = None
    runner.lora_config = None
    for name, value in changes.items():
        if name in ("tensor_parallel_size", "pipeline_parallel_size"):
            setattr(parallel, name, value)
        elif name == "cudagraph_mode":
            compilation.cudagraph_mode = getattr(CUDAGraphMode, value)
        else:
            setattr(runner, name, value)
    return runner


@pytest.mark.parametrize(
    ("changes", "serves"),
    [
        ({}, True),
        ({"device": torch.device("cpu")}, False),
        ({"tensor_parallel_size": 2}, False),
        ({"pipeline_parallel_size": 2}, False),
        ({"pcp_manager": object()}, False),
        ({"lora_config": object()}, False),
        ({"speculator": SimpleNamespace(draft_logits=torch.zeros(1))}, False),
        ({"speculator": None}, False),
        ({"cudagraph_mode": "NONE"}, False),  # enforce_eager: no graphs of ours either
        ({"cudagraph_mode": "PIECEWISE"}, True),
    ],
)
def test_graphs_serve_one_cuda_device_with_greedy_drafts(changes: dict, serves: bool) -> None:
    assert patch.graphs_serve(_serving_runner(**changes)) is serves


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_graphs_replay_what_the_launch_computes_eagerly() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(HIDDEN, 50, generator=gen).cuda()
    persistent = _persistent("cuda")
    persistent.input_ids.copy_(torch.randint(0, 50, (64,), generator=gen))

    def verify(rows: Any, width: int, indices: Any, cu: Any, idx: Any, lens: Any) -> Any:
        best = (rows @ weight).argmax(dim=-1)
        drafts = persistent.input_ids[indices]
        sampled = torch.where(best == drafts, best, -best).view(-1, width)
        counts = (cu[1:] - cu[:-1]) + idx
        return sampled, counts, counts * 2 + lens[idx.long()]

    ring = UvaRing(torch.arange(MAX_REQS, dtype=torch.int32), "cuda")
    graphs = VerifyGraphs(
        verify,
        persistent,
        lambda: (ring.gpu,),
        MAX_REQS,
        WIDTH,
        False,
        HIDDEN,
        torch.float32,
        torch.device("cuda"),
    )
    graphs.capture()
    assert sorted(graphs.graphs) == list(range(1, MAX_REQS + 1))
    for n in (MAX_REQS, 1, 3, 3):
        ring.np[:] = torch.randint(0, 1000, (MAX_REQS,), generator=gen).numpy()
        ring.copy_to_uva()  # what the graph captured is current every other step only
        batch = _batch(persistent, n)
        batch.logits_indices = batch.logits_indices.cuda()
        batch.cu_num_logits = batch.cu_num_logits.cuda()
        batch.idx_mapping = batch.idx_mapping.cuda()
        hidden = torch.randn(20, HIDDEN, device="cuda")
        got = graphs.run(hidden, batch)
        want = verify(
            hidden[batch.logits_indices],
            WIDTH,
            batch.logits_indices,
            batch.cu_num_logits,
            batch.idx_mapping,
            ring.gpu,
        )
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize(
    ("uncapped_env", "graphed_env", "serves", "built"),
    [
        (None, None, True, "uncapped"),  # the defaults
        ("0", None, True, "capped"),  # the graph keeps vLLM's capped logits
        (None, "0", True, None),
        (None, None, False, None),
    ],
)
def test_start_up_captures_the_graphs_the_switches_ask_for(
    monkeypatch: pytest.MonkeyPatch,
    set_env: Any,
    uncapped_env: str | None,
    graphed_env: str | None,
    serves: bool,
    built: str | None,
) -> None:
    import gemma4_spec.ops.capped_argmax as ops

    set_env(patch.UNCAPPED_VERIFY_ENV, uncapped_env)
    set_env(patch.GRAPHED_VERIFY_ENV, graphed_env)
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    monkeypatch.setattr(patch, "graphs_serve", lambda runner: serves)
    monkeypatch.setattr(ops, "capped_argmax", lambda x, cap: None)
    heads: list[Any] = []

    def build(runner: Any, head: Any) -> Any:
        heads.append(head)
        return SimpleNamespace(capture=lambda: None)

    monkeypatch.setattr(patch, "build_verify_graphs", build)
    runner = SimpleNamespace(
        model=SimpleNamespace(),
        model_config=SimpleNamespace(get_vocab_size=lambda: 8),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    head = patch.CappedHead(SimpleNamespace(), 30.0)
    setattr(runner, patch.CAPPED_HEAD_ATTR, head)
    patch.prepare(runner)
    # Where the logits come from is settled at start-up too (a suppressing target's ids are
    # copied to the device there, outside any capture).
    assert getattr(runner, patch.LOGITS_SOURCE_ATTR) == patch.LogitsSource(runner.model, None)
    graphs = getattr(runner, patch.VERIFY_GRAPHS_ATTR, None)
    if built is None:
        assert heads == [] and graphs is None
    else:
        assert heads == [head if built == "uncapped" else None] and graphs is not None


def test_a_failed_capture_leaves_the_engine_on_the_eager_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    monkeypatch.delenv(patch.GRAPHED_VERIFY_ENV, raising=False)
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    monkeypatch.setattr(patch, "graphs_serve", lambda runner: True)

    def failing_capture() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(
        patch, "build_verify_graphs", lambda r, h: SimpleNamespace(capture=failing_capture)
    )
    runner = SimpleNamespace(
        model=SimpleNamespace(), dtype=torch.float32, device=torch.device("cpu")
    )
    setattr(runner, patch.CAPPED_HEAD_ATTR, None)
    with caplog.at_level(logging.WARNING):
        patch.prepare(runner)
    assert getattr(runner, patch.VERIFY_GRAPHS_ATTR, None) is None
    assert "runs without graphs (capture failed: RuntimeError" in caplog.text
