"""``Gemma4Proposer._determine_batch_execution_and_padding``: the base class's answer, asked once
per batch size once vLLM's graph sizes are settled, and every time otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import CUDAGraphMode

from gemma4_spec.spec_decode.proposer import Gemma4Proposer


class Dispatcher:
    def __init__(self, initialized: bool) -> None:
        self.keys_initialized = initialized
        self.calls = 0

    def dispatch(self, num_tokens: int, valid_modes: object = None) -> tuple[object, object]:
        self.calls += 1
        if valid_modes == {CUDAGraphMode.NONE}:
            return CUDAGraphMode.NONE, SimpleNamespace(num_tokens=num_tokens)
        return CUDAGraphMode.FULL, SimpleNamespace(num_tokens=-(-num_tokens // 8) * 8)


def _proposer(initialized: bool) -> SimpleNamespace:
    return SimpleNamespace(
        cudagraph_dispatcher=Dispatcher(initialized),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1)),
        _padding={},
    )


def test_remembers_once_graph_sizes_are_settled() -> None:
    p = _proposer(initialized=True)
    decide = Gemma4Proposer._determine_batch_execution_and_padding
    for _ in range(3):
        assert decide(p, 3) == (CUDAGraphMode.FULL, 8, None)  # type: ignore[arg-type]
        assert decide(p, 9) == (CUDAGraphMode.FULL, 16, None)  # type: ignore[arg-type]
    assert p.cudagraph_dispatcher.calls == 2
    # Without graphs: asked every time, and not mixed up with the remembered answers.
    assert decide(p, 3, use_cudagraphs=False) == (CUDAGraphMode.NONE, 3, None)  # type: ignore[arg-type]
    assert decide(p, 3, use_cudagraphs=False) == (CUDAGraphMode.NONE, 3, None)  # type: ignore[arg-type]
    assert p.cudagraph_dispatcher.calls == 4


def test_asks_every_time_before_graph_sizes_are_settled() -> None:
    p = _proposer(initialized=False)
    decide = Gemma4Proposer._determine_batch_execution_and_padding
    for _ in range(3):
        decide(p, 3)  # type: ignore[arg-type]
    assert p.cudagraph_dispatcher.calls == 3 and not p._padding
