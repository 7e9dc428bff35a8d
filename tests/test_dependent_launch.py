"""Programmatic dependent launch of the draft's kernels (``ops/dependent_launch.py``): when it
is on, and that a chain of dependent launches captured in a CUDA graph computes what the same
chain without it computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.dependent_launch import PDL_ENV, dependent_launch
from gemma4_spec.ops.q_norm_rope import q_norm_rope
from gemma4_spec.ops.small_linear import small_linear, small_linear_gelu_and_mul

HEAD = 256
HEADS = 8


def test_off_unless_asked_and_never_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert not dependent_launch(torch.device("cpu"))
    monkeypatch.setenv(PDL_ENV, "1")
    assert not dependent_launch(torch.device("cpu")), "no grid dependencies on CPU"
    if torch.cuda.is_available():
        monkeypatch.setenv(PDL_ENV, "0")
        assert not dependent_launch(torch.device("cuda"))


def _chain_weights(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def matrix(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)

    return {
        "q": matrix(HEADS * HEAD, 256),
        "o": matrix(256, HEADS * HEAD),  # K = 2048: a split launch (counters, scratch)
        "gate_up": matrix(2 * 2048, 256),
        "down": matrix(256, 2048),
        "q_gain": (1 + torch.randn(HEAD, generator=gen) / 4).to(device, torch.bfloat16),
        "cache": torch.randn(512, HEAD, generator=gen).to(device, torch.bfloat16),
    }


def _chain(x: torch.Tensor, positions: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Four draft layers' worth of our kernels, each reading the one before it."""
    h = x
    for _ in range(4):
        q = q_norm_rope(small_linear(h, w["q"]), w["q_gain"], w["cache"], positions, 1e-6, HEAD)
        h = h + small_linear(q, w["o"])
        h = h + small_linear(small_linear_gelu_and_mul(h, w["gate_up"]), w["down"])
    return h


@pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()) or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9 or more",
)
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_dependent_chain_in_a_graph_equals_the_plain_chain(
    monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    weights = _chain_weights("cuda")
    x = torch.zeros(rows, 256, device="cuda", dtype=torch.bfloat16)
    positions = torch.zeros(rows, device="cuda", dtype=torch.long)
    graphs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv(PDL_ENV, pdl)
        assert dependent_launch(torch.device("cuda")) == (pdl == "1")
        _chain(x, positions, weights)  # compiles, makes the split counters, outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, positions, weights)
        graphs[pdl] = (graph, out)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x.copy_(torch.randn(rows, 256, generator=gen))
        positions.copy_(torch.randint(0, 512, (rows,), generator=gen))
        results = {}
        for pdl, (graph, out) in graphs.items():
            graph.replay()
            results[pdl] = out.clone()
        assert torch.equal(results["1"], results["0"])
