"""``spec_decode/computed_tokens.py``: the graphed correction gives what vLLM's function gives
(replayed from graphs on CUDA, where the same tensors come back with new values), routes only
registered runners to graphs, and installs once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gemma4_spec.spec_decode.computed_tokens import (
    CORRECTION_NAME,
    GraphedCorrection,
    install,
    register_runner,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(n_prev: int, n: int) -> list[torch.Tensor]:
    """The runner's tensors the correction reads and writes (fixed buffers, sliced)."""
    return [
        torch.zeros(64, dtype=torch.int32, device=DEVICE),  # num_computed_tokens
        torch.ones(64, dtype=torch.int32, device=DEVICE)[:n],  # num_accepted_tokens
        torch.zeros(64, dtype=torch.int32, device=DEVICE)[:n],  # prev_positions
        torch.zeros(n_prev, dtype=torch.int32, device=DEVICE),  # previous kept counts
        torch.zeros(64, dtype=torch.int32, device=DEVICE),  # prev_num_draft_tokens
        torch.zeros(n, dtype=torch.int32, device=DEVICE),  # host-side counts, sent
    ]


def _refill(ts: list[torch.Tensor], gen: torch.Generator, n_prev: int) -> None:
    """New values, same tensors (as the runner's buffers are from step to step)."""
    n = ts[1].shape[0]

    def rand(low: int, high: int, size: int) -> torch.Tensor:
        return torch.randint(low, high, (size,), generator=gen, dtype=torch.int32).to(DEVICE)

    ts[0].copy_(rand(0, 1000, 64))
    ts[1].copy_(rand(1, 4, n))
    ts[2].copy_(rand(-1, n_prev, n))  # -1: a new request
    ts[3].copy_(rand(1, 4, n_prev))
    ts[4].copy_(rand(0, 3, 64))
    ts[5].copy_(rand(0, 1000, n))


def test_matches_vllms_function() -> None:
    from vllm.v1.spec_decode.utils import update_num_computed_tokens_for_batch_change as vllms

    correction = GraphedCorrection(vllms)
    gen = torch.Generator().manual_seed(0)
    ours, theirs = _tensors(6, 5), _tensors(6, 5)
    correction.register(ours[0])
    for _ in range(6):
        _refill(ours, gen, 6)
        for a, b in zip(theirs, ours, strict=True):
            a.copy_(b)
        correction(*ours)
        vllms(*theirs)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    if DEVICE == "cuda":
        assert correction.launches.replays == 5  # captured at the first call, then replayed


def test_matches_vllms_function_as_the_batch_changes() -> None:
    """The runner's buffers keep their addresses while the batch's length changes: a replay of
    a graph captured for another length would correct the wrong requests."""
    from vllm.v1.spec_decode.utils import update_num_computed_tokens_for_batch_change as vllms

    correction = GraphedCorrection(vllms)
    gen = torch.Generator().manual_seed(1)
    ours_buffers, theirs_buffers = _tensors(64, 64), _tensors(64, 64)
    correction.register(ours_buffers[0])

    def views(buffers: list[torch.Tensor], n_prev: int, n: int) -> list[torch.Tensor]:
        b = buffers
        return [b[0], b[1][:n], b[2][:n], b[3][:n_prev], b[4], b[5][:n]]

    lengths = [(6, 5), (6, 5), (5, 3), (6, 5), (5, 3), (3, 7)]
    for n_prev, n in lengths:
        ours, theirs = views(ours_buffers, n_prev, n), views(theirs_buffers, n_prev, n)
        _refill(ours, gen, n_prev)
        for a, b in zip(theirs, ours, strict=True):
            a.copy_(b)
        correction(*ours)
        vllms(*theirs)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), (n_prev, n)
    if DEVICE == "cuda":  # one graph per set of lengths, each replayed when it comes back
        assert correction.launches.captured == len(set(lengths))
        assert correction.launches.replays == len(lengths) - len(set(lengths))


def test_unregistered_runners_call_vllm_as_it_is() -> None:
    calls = []
    correction = GraphedCorrection(lambda *args, **kwargs: calls.append(len(args)))
    ts = _tensors(3, 2)
    correction(*ts)
    correction(*ts)
    assert (
        calls == [6, 6] and correction.launches.replays == 0 and correction.launches.captured == 0
    )


@pytest.mark.parametrize("times", [1, 2])
def test_install_and_register(times: int) -> None:
    module = SimpleNamespace(**{CORRECTION_NAME: lambda *args: None})
    for _ in range(times):
        install(module)
    wrapped = getattr(module, CORRECTION_NAME)
    assert isinstance(wrapped, GraphedCorrection)
    assert not isinstance(wrapped.vllms, GraphedCorrection)  # wrapped once


def test_register_runner_reaches_the_runner_module() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    install(runner_module)
    correction = getattr(runner_module, CORRECTION_NAME)
    runner = SimpleNamespace(num_computed_tokens=torch.zeros(8, dtype=torch.int32))
    register_runner(runner)
    assert runner.num_computed_tokens.data_ptr() in correction._runners
