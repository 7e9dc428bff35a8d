"""``spec_decode/runner_v2.py``'s draft loop, on CPU: what it proposes for a verified batch,
against a hand-written recurrence, with vLLM's model call and sampling replaced by simple
stand-ins (the GPU engine test runs it with the real ones, on the vLLM it is installed on).

Checked: each request's first step starts from its last accepted row (the step's last token
less the rejected ones) with its last sampled token, or its next prompt token while it is
being prefilled; every later step feeds the previous step's token and hidden state; the keys
end at the last accepted token; padding rows of a graph size get no keys; where vLLM's graph
manager has a graph for the batch it is replayed instead of running eagerly; data parallelism
goes to vLLM's own ``propose``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBuffers  # noqa: E402

from gemma4_spec.spec_decode.runner_v2 import Gemma4LoopSpeculator  # noqa: E402

H = 6  # target hidden width
MAX_REQS, MAX_TOKENS = 16, 64


class _Speculator(Gemma4LoopSpeculator):
    """Our loop over stand-ins for what it takes from vLLM: the buffers vLLM's constructor
    makes, its model call (``_run_model``), its sampling and its metadata build."""

    def __init__(self, k: int, manager: Any = None, dp_size: int = 1) -> None:  # no super()
        self.num_speculative_steps = k
        self.dp_size = dp_size
        self.device = torch.device("cpu")
        self.supports_mm_inputs = False
        self.max_model_len = 4096
        self.eplb_state = None
        self.input_buffers = InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))
        self.hidden_states = torch.zeros(MAX_TOKENS, H)
        self.idx_mapping = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.temperature = torch.zeros(MAX_REQS)
        self.seeds = torch.zeros(MAX_REQS, dtype=torch.int64)
        self.current_draft_step = torch.tensor(0)
        self.draft_logits = None
        self.draft_tokens = torch.zeros(MAX_REQS, k, dtype=torch.int64)
        self.decode_cudagraph_manager = manager
        self.built: list[tuple[list[int], list[int]]] = []  # (seq_lens, query_start_loc)
        self._init_loop_state()

    def _build_draft_attn_metadata(self, **kwargs: Any) -> dict[str, Any]:
        n = kwargs["num_reqs_padded"]
        self.built.append(
            (
                self.input_buffers.seq_lens[:n].tolist(),
                self.input_buffers.query_start_loc[: n + 1].tolist(),
            )
        )
        return {"layer.0": SimpleNamespace(rows=n), "layer.1": SimpleNamespace(rows=n)}

    def _run_model(self, num_tokens: int, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _step(
            self.input_buffers.input_ids[:num_tokens],
            self.input_buffers.positions[:num_tokens],
            self.hidden_states[:num_tokens],
        )

    def sample_draft(self, hidden_states: torch.Tensor, *args: Any) -> torch.Tensor:
        return _sample(hidden_states)


def _step(ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor) -> tuple[Any, Any]:
    """A draft step's stand-in: (what is sampled from, the next step's hidden state)."""
    out = hidden * 0.5 + ids[:, None].float() + pos[:, None].float() * 0.01
    return out, out.flip(-1) - 1.0


def _sample(out: torch.Tensor) -> torch.Tensor:
    return (out.sum(-1) * 7).long().remainder(997)


def _verified_batch() -> tuple[Any, dict[str, torch.Tensor]]:
    """Three requests (states 5, 2, 9): two verified 4 tokens each, one is a prompt chunk of
    3 tokens that samples nothing; request 0 rejected 2 drafts, request 1 none."""
    gen = torch.Generator().manual_seed(0)
    qsl = torch.tensor([0, 4, 8, 11], dtype=torch.int32)
    seq_lens = torch.tensor([30, 51, 70], dtype=torch.int32)
    batch = SimpleNamespace(
        num_reqs=3,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        positions=torch.tensor([26, 27, 28, 29, 47, 48, 49, 50, 67, 68, 69]),
        idx_mapping=torch.tensor([5, 2, 9], dtype=torch.int32),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    inputs = {
        "last_hidden_states": torch.randn(11, H, generator=gen),
        "num_sampled": torch.tensor([1, 4, 0], dtype=torch.int32),
        "num_rejected": torch.tensor([2, 0, 0], dtype=torch.int32),
        "last_sampled": torch.arange(100, 116).view(16, 1),  # vLLM's [states, 1]
        "next_prefill_tokens": torch.arange(200, 216, dtype=torch.int32),
    }
    return batch, inputs


def _propose(spec: _Speculator, batch: Any, inputs: dict[str, torch.Tensor]) -> Any:
    return spec.propose(
        batch,
        {},
        {},
        inputs["last_hidden_states"],
        None,
        inputs["num_sampled"],
        inputs["num_rejected"],
        inputs["last_sampled"],
        inputs["next_prefill_tokens"],
        torch.zeros(MAX_REQS),
        torch.zeros(MAX_REQS, dtype=torch.int64),
    )


def _expected(k: int) -> list[list[int]]:
    """The recurrence, by hand: rows 1 (4 - 1 - 2), 7 and 10; tokens 105 (state 5's last
    sampled), 102, and 209 (state 9's next prompt token: its chunk sampled nothing)."""
    batch, inputs = _verified_batch()
    rows = torch.tensor([1, 7, 10])
    ids = torch.tensor([105, 102, 209], dtype=torch.int32)
    pos = batch.positions[rows]
    hidden = inputs["last_hidden_states"][rows]
    drafts = []
    for _ in range(k):
        out, hidden = _step(ids, pos, hidden)
        ids = _sample(out).to(torch.int32)
        drafts.append(ids.long())
    return torch.stack(drafts, dim=1).tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_eager_loop_drafts_from_each_requests_last_accepted_token(k: int) -> None:
    spec = _Speculator(k)
    batch, inputs = _verified_batch()
    assert _propose(spec, batch, inputs).tolist() == _expected(k)
    assert (spec.loop_eager, spec.loop_replays) == (1, 0)
    # The keys end at the last accepted token: 30 - 2 rejected; one query per request.
    assert spec.built == [([28, 51, 70], [0, 1, 2, 3])]


def test_draft_batches_marked_for_our_attention_only_where_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gemma4_spec.patch import patch_split_attention as routing

    batch, inputs = _verified_batch()
    marked = []
    for mode in (None, "sliding"):
        spec = _Speculator(2)
        built = {"layer.0": SimpleNamespace(), "layer.1": SimpleNamespace()}
        monkeypatch.setattr(spec, "_build_draft_attn_metadata", lambda b=built, **kw: b.copy())
        monkeypatch.setattr(
            "gemma4_spec.spec_decode.runner_v2.route_draft", lambda device, m=mode: m
        )
        assert _propose(spec, batch, inputs).tolist() == _expected(2)
        marked.append([getattr(m, routing.DRAFT_ATTR, None) for m in built.values()])
    assert marked == [[None, None], ["sliding", "sliding"]]


class _Manager:
    """vLLM's graph manager's part in the loop: a graph of ``size`` rows, replayed as the
    eager loop over those rows (what the captured graph does)."""

    def __init__(self, spec_of: Any, size: int) -> None:
        self.spec_of, self.size, self.replayed = spec_of, size, []

    def dispatch(self, num_reqs: int, num_tokens: int, uniform: int, loras: int) -> Any:
        assert (num_tokens, uniform, loras) == (num_reqs, 1, 0)
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, self.size, self.size, 1)

    def run_fullgraph(self, desc: Any) -> None:
        spec = self.spec_of()
        self.replayed.append(spec.input_buffers.seq_lens[: desc.num_tokens].tolist())
        spec._draft_loop(desc.num_tokens, desc.num_tokens, None, None, None)


def test_graph_replay_drafts_the_same_with_padding_rows_keyless() -> None:
    holder: list[_Speculator] = []
    manager = _Manager(lambda: holder[0], size=4)
    spec = _Speculator(3, manager=manager)
    holder.append(spec)
    spec.input_buffers.seq_lens.fill_(-7)  # stale values from an earlier step
    batch, inputs = _verified_batch()
    assert _propose(spec, batch, inputs).tolist() == _expected(3)
    assert (spec.loop_eager, spec.loop_replays) == (0, 1)
    assert manager.replayed == [[28, 51, 70, 0]]  # the padding row has no keys
    assert spec.input_buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 3]
    assert spec.built == []  # the graph holds its metadata


def test_data_parallel_engines_keep_vllms_propose_and_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    base = Gemma4LoopSpeculator.__mro__[1]
    monkeypatch.setattr(base, "propose", lambda self, *a, **kw: calls.append("propose") or "vllm's")
    monkeypatch.setattr(base, "capture", lambda self: calls.append("capture"))
    spec = _Speculator(3, manager=_Manager(lambda: spec, size=4), dp_size=2)
    spec.capture()  # vLLM's graphs, not draft-loop graphs its propose would misread
    batch, inputs = _verified_batch()
    assert _propose(spec, batch, inputs) == "vllm's"
    assert calls == ["capture", "propose"] and spec.loop_eager == spec.loop_replays == 0


@pytest.mark.parametrize("dp_size", [1, 2])
def test_graph_managers_are_built_without_the_speculation_length_schedule(
    monkeypatch: pytest.MonkeyPatch, dp_size: int
) -> None:
    # Where our loop drafts, vLLM's graph managers are built with no per-k schedule (its
    # one-query graphs serve every k; vLLM 0.26 divides by zero deriving one-query lengths from
    # it), and the engine's config keeps the schedule for the scheduler. Where vLLM's propose
    # drafts (data parallelism), its managers see the schedule as vLLM built them.
    schedule = [[1, 8, 3], [9, 64, 1]]
    seen: list[Any] = []
    base = Gemma4LoopSpeculator.__mro__[1]
    monkeypatch.setattr(
        base,
        "init_cudagraph_manager",
        lambda self, mode: seen.append(
            self.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
        ),
    )
    spec = _Speculator(3, dp_size=dp_size)
    config = SimpleNamespace(num_speculative_tokens_per_batch_size=schedule)
    spec.vllm_config = SimpleNamespace(speculative_config=config)
    spec.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert seen == [None if dp_size == 1 else schedule]
    assert config.num_speculative_tokens_per_batch_size is schedule
