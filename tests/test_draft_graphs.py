"""What of the whole-draft-loop graphs (``spec_decode/draft_graphs.py``) can be checked without
a GPU: when they are off, the staging and padding of a batch into the graphs' buffers, when a
replay rebuilds the attention metadata. Capture and replay run in tests/test_gpu_engine.py (CUDA
only)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from gemma4_spec.spec_decode.draft_graphs import (
    FULL_DRAFT_GRAPHS_ENV,
    DraftLoopGraphs,
    _moved_tensors,
    _pad_common_metadata,
    loop_graph_size,
)


def _proposer(device: str = "cpu", dp: int = 1, eager: bool = False) -> SimpleNamespace:
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp),
        model_config=SimpleNamespace(enforce_eager=eager),
    )
    return SimpleNamespace(device=torch.device(device), vllm_config=config)


def test_off_without_cuda() -> None:
    graphs = DraftLoopGraphs(_proposer("cpu"))  # type: ignore[arg-type]
    assert graphs.disabled == "no CUDA"
    assert graphs.draft(4, 4, 2, *[None] * 6) is None  # type: ignore[arg-type]
    assert graphs.captured == []


@pytest.mark.parametrize(
    ("kwargs", "env", "reason"),
    [
        ({"dp": 2}, None, "data parallelism"),
        ({"eager": True}, None, "enforce_eager"),
        ({}, "0", f"{FULL_DRAFT_GRAPHS_ENV}=0"),
    ],
)
def test_off_when_unsupported_or_asked(monkeypatch, kwargs, env, reason) -> None:  # type: ignore[no-untyped-def]
    if env is not None:
        monkeypatch.setenv(FULL_DRAFT_GRAPHS_ENV, env)
    proposer = _proposer("cuda", **kwargs)  # a device object only; nothing runs on it
    assert DraftLoopGraphs(proposer).disabled == reason  # type: ignore[arg-type]


def _metadata(batch: int) -> CommonAttentionMetadata:
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), 9, dtype=torch.int32),
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=9,
        block_table_tensor=torch.zeros(batch, 4, dtype=torch.int32),
        slot_mapping=torch.arange(batch, dtype=torch.int64),
        positions=torch.arange(batch),
        is_prefilling=torch.zeros(batch, dtype=torch.bool),
        encoder_seq_lens_cpu=np.zeros(batch, dtype=np.int32),
    )


def test_padding_replaces_the_batch_and_drops_other_per_request_fields() -> None:
    batch, size = 3, 8
    metadata = _metadata(batch)
    seq_lens = torch.ones(size, dtype=torch.int32)
    padded = _pad_common_metadata(
        metadata,
        batch,
        seq_lens=seq_lens,
        num_reqs=size,
        num_actual_tokens=size,
        query_start_loc=torch.arange(size + 1, dtype=torch.int32),
        positions=torch.zeros(size, dtype=torch.long),
    )
    assert padded.seq_lens is seq_lens and padded.num_reqs == size
    assert padded.positions is not None and padded.positions.shape[0] == size
    # Per-request optional fields sized for the unpadded batch would not match: dropped.
    assert padded.is_prefilling is None and padded.encoder_seq_lens_cpu is None
    # Required fields not replaced stay as they were; the original is untouched.
    assert padded.block_table_tensor is metadata.block_table_tensor
    assert metadata.num_reqs == batch and metadata.is_prefilling is not None


class _FakeProposer(SimpleNamespace):
    """What ``DraftLoopGraphs.draft`` reads of the proposer, on CPU tensors."""

    def __init__(
        self, tables: dict[int, torch.Tensor], capacity: int = 16, backend: str = "TRITON_ATTN"
    ) -> None:
        config = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=1),
            model_config=SimpleNamespace(enforce_eager=False, max_model_len=512),
            compilation_config=SimpleNamespace(max_cudagraph_capture_size=capacity),
        )
        named = SimpleNamespace(get_name=lambda: backend)
        super().__init__(
            device=torch.device("cpu"),
            vllm_config=config,
            draft_attn_groups=[
                SimpleNamespace(kv_cache_group_id=g, backend=named) for g in (0, 1, 1)
            ],
            arange=torch.arange(capacity + 1, dtype=torch.int32),
            token_arange_np=np.arange(capacity + 1, dtype=np.int32),
            input_ids=torch.full((capacity,), -5, dtype=torch.int32),
            positions=torch.full((capacity,), -5, dtype=torch.long),
            hidden_states=torch.full((capacity, 4), -5.0),
            tables=tables,
            slot_buffer=torch.zeros(capacity, dtype=torch.int64),
            built=[],
        )

    def block_table_of(self, gid: int, metadata: CommonAttentionMetadata) -> torch.Tensor:
        return self.tables.get(gid, metadata.block_table_tensor)

    def _one_query_per_request(
        self, metadata: CommonAttentionMetadata, rows: torch.Tensor, rejected: torch.Tensor
    ) -> CommonAttentionMetadata:
        return metadata  # already one query per request in these tests

    def _get_slot_mapping(self, num_tokens: int, slot_mapping: torch.Tensor) -> dict:
        self.slot_buffer[: slot_mapping.shape[0]].copy_(slot_mapping)
        self.slot_buffer[slot_mapping.shape[0] : num_tokens].fill_(-1)
        return {"layer": self.slot_buffer[:num_tokens]}

    def metadata_over_tables(self, metadata: CommonAttentionMetadata, tables: dict) -> tuple:
        self.built.append((metadata, tables))
        return [], {"layer": metadata}


class _Recorder(DraftLoopGraphs):
    """Draft-loop graphs with capture and replay recorded instead of run (no CUDA here)."""

    def __init__(self, proposer: _FakeProposer) -> None:
        super().__init__(proposer)  # type: ignore[arg-type]
        self.disabled = None  # as on CUDA
        self.events: list[str] = []

    def _backends_support_full_graphs(self) -> str | None:
        return None

    def _capture(self, size, k, metadata, per_layer, slot_mapping):  # type: ignore[no-untyped-def]
        self.events.append(f"capture {size}x{k}")
        self._graphs[(size, k)] = (None, torch.zeros(size, k, dtype=torch.int64))  # type: ignore[assignment]

    def _replay(self, graph, tokens, batch_size):  # type: ignore[no-untyped-def]
        self.events.append("replay")
        self.replays += 1
        return tokens[:batch_size].clone()


def _draft(graphs: DraftLoopGraphs, batch: int, size: int, metadata: CommonAttentionMetadata):  # type: ignore[no-untyped-def]
    hidden = torch.arange(3 * batch * 4, dtype=torch.float32).view(3 * batch, 4)
    return graphs.draft(
        batch,
        size,
        2,
        metadata,
        torch.arange(batch, dtype=torch.int32) + 70,  # next token ids
        torch.arange(3 * batch) + 100,  # the target step's positions (3 tokens a request)
        hidden,
        torch.arange(batch, dtype=torch.int32) * 3 + 2,  # each request's last accepted row
        torch.ones(batch, dtype=torch.int32),  # one token rejected each
    )


def _runner_tables(
    capacity: int = 16, widths: tuple[int, int] = (4, 4)
) -> tuple[torch.Tensor, ...]:
    """The runner's block tables of KV cache groups 0 and 1 (filled: a capture must not read
    them)."""
    return tuple(
        torch.arange(capacity * w, dtype=torch.int32).view(capacity, w) + 1 for w in widths
    )


def test_startup_captures_every_size_over_dummy_requests() -> None:
    proposer = _FakeProposer({})
    proposer.input_ids.fill_(7)
    graphs = _Recorder(proposer)
    graphs.capture_at_startup([2, 8, 4], 2, _runner_tables(widths=(4, 8)))
    assert graphs.captured_at_startup
    assert graphs.events == ["capture 8x2", "capture 4x2", "capture 2x2"]  # largest first
    assert graphs.captured == [(2, 2), (4, 2), (8, 2)]
    padded, tables = proposer.built[0]  # the 8-row capture's metadata
    # Dummy requests: one key each, on the null block, writing no K/V.
    assert padded.num_reqs == 8 and padded.num_actual_tokens == 8 and padded.max_query_len == 1
    assert padded.query_start_loc.tolist() == list(range(9))
    assert padded.seq_lens.tolist() == [1] * 8
    assert padded.max_seq_len == 512
    assert proposer.slot_buffer[:8].tolist() == [-1] * 8
    assert not proposer.input_ids[:8].any() and proposer.input_ids[8] == 7
    assert sorted(tables) == [0, 1]  # one table per KV cache group, however many layer groups
    assert tables[0].shape == (8, 4) and tables[1].shape == (8, 8)
    assert not tables[0].any() and not tables[1].any()
    assert graphs._buffers is not None
    assert padded.seq_lens.data_ptr() == graphs._buffers.seq_lens.data_ptr()
    graphs.capture_at_startup([16], 2, _runner_tables(widths=(4, 8)))  # once per engine
    assert graphs.captured == [(2, 2), (4, 2), (8, 2)]


def test_draft_stages_the_batch_into_the_captured_buffers_and_replays() -> None:
    batch, size = 3, 8
    runner_tables = {1: torch.arange(40, dtype=torch.int32).view(5, 8) + 100}
    proposer = _FakeProposer(runner_tables)
    graphs = _Recorder(proposer)
    graphs.capture_at_startup([size], 2, _runner_tables(widths=(4, 8)))
    builds = len(proposer.built)
    metadata = _metadata(batch)
    metadata.block_table_tensor = torch.arange(5 * 4, dtype=torch.int32).view(5, 4) + 1

    assert _draft(graphs, batch, size, metadata) is not None
    assert graphs.events == ["capture 8x2", "replay"]
    # The Triton backend's metadata needs no rebuild before a replay.
    assert graphs.rebuild_free and len(proposer.built) == builds
    buffers = graphs._buffers
    assert buffers is not None
    # The batch, then padding rows: one key each, on the null block.
    assert buffers.seq_lens[:size].tolist() == [8, 8, 8, 1, 1, 1, 1, 1]  # 9 keys less 1 rejected
    assert proposer.input_ids[:size].tolist() == [70, 71, 72, 0, 0, 0, 0, 0]
    assert proposer.positions[:size].tolist() == [102, 105, 108, 0, 0, 0, 0, 0]
    assert proposer.hidden_states[1].tolist() == [20.0, 21.0, 22.0, 23.0]  # target row 5
    assert not proposer.hidden_states[batch:size].any()
    assert proposer.input_ids[size] == -5  # nothing past the graph's rows
    tables = buffers.tables
    assert tables[0][:batch].tolist() == metadata.block_table_tensor[:batch].tolist()
    assert tables[1][:batch].tolist() == runner_tables[1][:batch].tolist()
    assert not tables[0][batch:size].any() and not tables[1][batch:size].any()

    # A smaller batch in the same graph: restaged into the same memory and replayed.
    assert _draft(graphs, 2, size, _metadata(2)) is not None
    assert graphs.events == ["capture 8x2", "replay", "replay"] and graphs.replays == 2
    assert buffers.seq_lens[:size].tolist() == [8, 8, 1, 1, 1, 1, 1, 1]
    assert not buffers.tables[1][2:size].any()


def test_a_size_not_captured_at_startup_drafts_step_by_step() -> None:
    # Nothing is captured in a request's path: a miss takes the step-by-step path.
    proposer = _FakeProposer({})
    graphs = _Recorder(proposer)
    graphs.capture_at_startup([4], 2, _runner_tables())
    assert _draft(graphs, 3, 8, _metadata(3)) is None
    assert graphs.events == ["capture 4x2"] and graphs.misses == 1
    assert _draft(graphs, 3, 4, _metadata(3)) is not None


def test_other_backends_rebuild_the_metadata_before_each_replay() -> None:
    proposer = _FakeProposer({}, backend="FLASH_ATTN")
    graphs = _Recorder(proposer)
    graphs.capture_at_startup([4], 2, _runner_tables())
    builds = len(proposer.built)
    _draft(graphs, 2, 4, _metadata(2))
    _draft(graphs, 2, 4, _metadata(2))
    assert graphs.events == ["capture 4x2", "replay", "replay"]
    assert len(proposer.built) == builds + 2
    assert not graphs.rebuild_free


def test_draft_refuses_what_the_buffers_cannot_hold() -> None:
    proposer = _FakeProposer({}, capacity=4)
    graphs = _Recorder(proposer)
    graphs.capture_at_startup([4], 2, _runner_tables(4))
    assert _draft(graphs, 3, 8, _metadata(3)) is None  # past the largest capture size
    assert _draft(graphs, 3, 4, _metadata(3)) is not None
    wider = _metadata(3)
    wider.block_table_tensor = torch.zeros(3, 6, dtype=torch.int32)
    assert _draft(graphs, 3, 4, wider) is None  # table width changed: graphs off
    assert graphs.disabled is not None and "width" in graphs.disabled


def test_metadata_built_in_fresh_memory_is_caught() -> None:
    # A graph captured over one build reads the memory of that build; a builder that puts a
    # tensor in new memory every time would leave the graph reading stale values.
    seq_lens, table = torch.ones(4, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32)
    stable = SimpleNamespace(seq_lens=seq_lens, block_table=table, max_seq_len=9)
    same = SimpleNamespace(seq_lens=seq_lens, block_table=table, max_seq_len=9)
    fresh = SimpleNamespace(seq_lens=seq_lens.clone(), block_table=table, max_seq_len=9)
    assert _moved_tensors({"a": stable, "b": stable}, {"a": same, "b": same}, "cpu") == ""
    moved = _moved_tensors({"a": stable}, {"a": fresh}, "cpu")
    assert moved == "SimpleNamespace.seq_lens"
    # Only tensors on the drafting device matter (CPU mirrors are not read by the graph).
    assert _moved_tensors({"a": stable}, {"a": fresh}, "cuda") == ""


@pytest.mark.parametrize(
    ("batch", "runner", "size"),
    [(1, 3, 1), (2, 3, 2), (3, 3, 3), (3, 6, 4), (5, 6, 6), (8, 9, 8), (9, 9, 9), (9, 12, 12),
     (9, 18, 16), (32, 33, 32), (33, 36, 36), (33, 48, 40)],
)  # fmt: skip
def test_loop_graph_sizes(batch: int, runner: int, size: int) -> None:
    # The runner's drafter sizes are multiples of 1 + k; ours are powers of two to 8, then
    # multiples of 8, and never more than the runner's.
    assert loop_graph_size(batch, runner) == size


@pytest.mark.parametrize(
    ("names", "version", "free"),
    [
        ({"TRITON_ATTN"}, "0.26.0", True),
        ({"TRITON_ATTN"}, "0.32.0", True),
        ({"TRITON_ATTN"}, "0.29.1", False),  # sources not read: rebuild before every replay
        ({"TRITON_ATTN", "FLASH_ATTN"}, "0.26.0", False),
        ({"FLASH_ATTN"}, "0.26.0", False),
        (set(), "0.26.0", False),
    ],
)
def test_which_draft_backends_replay_without_a_metadata_rebuild(
    names: set[str], version: str, free: bool
) -> None:
    from packaging.version import Version

    from gemma4_spec.compat import draft_metadata_rebuild_free

    assert draft_metadata_rebuild_free(names, Version(version)) is free


# --- tensor parallelism: every rank captures the same graphs, or none ------------------------


class _RankGraphs(DraftLoopGraphs):
    """One rank's draft-loop graphs, over a CPU process group: the capture's warm-up and
    recording are recorded instead of run, and fail where told to."""

    def __init__(self, group: object, fail_warm_up: int | None, fail_record: int | None) -> None:
        super().__init__(_FakeProposer({}))  # type: ignore[arg-type]
        self.disabled = None  # as on CUDA
        self.group, self.fail_warm_up, self.fail_record = group, fail_warm_up, fail_record
        self.events: list[str] = []

    def _rank_group(self) -> object:
        return self.group

    def _backends_support_full_graphs(self) -> str | None:
        return None

    def _warm_up(self, size, k, metadata, per_layer, slot_mapping, tokens):  # type: ignore[no-untyped-def]
        self.events.append(f"warm-up {size}")
        failed = "fresh metadata memory" if size == self.fail_warm_up else None
        return failed, (per_layer, slot_mapping)

    def _record(self, size, k, rebuilt, tokens):  # type: ignore[no-untyped-def]
        self.events.append(f"record {size}")
        if size == self.fail_record:
            return None, f"capture of {size} x {k} failed: out of memory"
        return object(), None


# Per case: {rank: (warm-up failing at size, recording failing at size)}.
_RANK_CASES: dict[str, dict[int, tuple[int | None, int | None]]] = {
    "all-capture": {},
    "rank-1-capture-fails": {1: (None, 4)},
    "rank-0-warm-up-fails": {0: (8, None)},
}


def _capture_on_rank(rank: int, store: str, out: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for case, failures in _RANK_CASES.items():
        graphs = _RankGraphs(dist.group.WORLD, *failures.get(rank, (None, None)))
        graphs.capture_at_startup([2, 8, 4], 2, _runner_tables())
        results[case] = {
            "events": graphs.events,
            "disabled": graphs.disabled,
            "captured": graphs.captured,
        }
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(results, handle)


@pytest.fixture(scope="module")
def two_rank_captures(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each of two ranks (processes over a gloo group) captured, per case."""
    import json

    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("ranks")
    out = str(root / "result")
    mp.spawn(_capture_on_rank, args=(str(root / "store"), out), nprocs=2)
    return [json.loads(open(f"{out}.{rank}").read()) for rank in (0, 1)]


def test_ranks_capture_the_same_graphs(two_rank_captures: list[dict]) -> None:
    for rank in two_rank_captures:
        case = rank["all-capture"]
        assert case["disabled"] is None
        assert case["captured"] == [[2, 2], [4, 2], [8, 2]]
        assert case["events"] == [
            "warm-up 8",
            "record 8",
            "warm-up 4",
            "record 4",
            "warm-up 2",
            "record 2",
        ]


def test_a_capture_failing_on_one_rank_turns_the_graphs_off_on_every_rank(
    two_rank_captures: list[dict],
) -> None:
    # Rank 0 would otherwise replay its graphs while rank 1 drafts step by step: their
    # all-reduces would no longer pair up.
    for rank in two_rank_captures:
        case = rank["rank-1-capture-fails"]
        assert case["disabled"] == (
            "capture of 4 x 2 failed: out of memory (on tensor-parallel rank 1)"
        )
        assert case["captured"] == []
        assert case["events"] == ["warm-up 8", "record 8", "warm-up 4", "record 4"]


def test_a_warm_up_failing_on_one_rank_keeps_every_rank_from_capturing(
    two_rank_captures: list[dict],
) -> None:
    # No rank records a graph its peers do not: vLLM's custom all-reduce pairs the ranks'
    # recorded buffers in the order they were captured.
    for rank in two_rank_captures:
        case = rank["rank-0-warm-up-fails"]
        assert case["disabled"] == "fresh metadata memory (on tensor-parallel rank 0)"
        assert case["captured"] == []
        assert case["events"] == ["warm-up 8"]


def test_one_rank_decides_alone() -> None:
    from gemma4_spec.spec_decode.rank_agreement import first_failure, tensor_parallel_cpu_group

    assert tensor_parallel_cpu_group() is None  # no vLLM worker here
    assert first_failure(None, None) is None
    assert first_failure("boom", None) == "boom"
