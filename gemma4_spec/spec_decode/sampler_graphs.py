"""Greedy draft sampling replayed from CUDA graphs (the step-by-step drafting path).

vLLM's V1 drafter graphs cover the model's forward (piecewise); sampling runs after it, eagerly,
as a few small kernels (centroid scores, top-k, the argmax over the picked rows). At the batch
sizes of decoding their launch cost is most of their time, so we capture the sampling of each
batch size the runner captures and replay it: one launch per draft step. Sizes never captured
(or no CUDA, or ``enforce_eager``) take the eager path, which computes the same tokens. When
the whole draft loop is replayed from one graph (``draft_graphs.py``), sampling is inside it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

Sampler = Callable[[torch.Tensor], torch.Tensor]


class GraphedGreedySampler:
    """``sample(hidden [B, d]) -> token ids [B]``, from a captured graph when there is one for a
    batch size >= B (rows past B are stale padding; their tokens are dropped)."""

    def __init__(
        self, sample: Sampler, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._sample = sample
        self._hidden_size = hidden_size
        self._dtype = dtype
        self._device = device
        self._hidden: torch.Tensor | None = None  # static input, sized for the largest capture
        self._tokens: torch.Tensor | None = None  # static output
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._sizes: list[int] = []  # captured batch sizes, ascending

    @property
    def captured_sizes(self) -> list[int]:
        return list(self._sizes)

    def capture(self, batch_size: int, pool: object = None) -> None:
        """Capture sampling for ``batch_size`` rows (no-op without CUDA or if already done)."""
        if self._device.type != "cuda" or batch_size in self._graphs:
            return
        if self._hidden is None or self._hidden.shape[0] < batch_size:
            # vLLM captures the largest size first; growing later would orphan earlier graphs'
            # buffers, so those are dropped and recaptured on demand only by size.
            self._graphs.clear()
            self._sizes.clear()
            self._hidden = torch.zeros(
                batch_size, self._hidden_size, dtype=self._dtype, device=self._device
            )
            self._tokens = torch.zeros(batch_size, dtype=torch.long, device=self._device)
        hidden = self._hidden[:batch_size]
        assert self._tokens is not None
        # Eager run first: compiles kernels and builds any per-weight state outside capture.
        self._tokens[:batch_size] = self._sample(hidden)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._tokens[:batch_size] = self._sample(hidden)
        self._graphs[batch_size] = graph
        bisect.insort(self._sizes, batch_size)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        at = bisect.bisect_left(self._sizes, rows)
        if at == len(self._sizes) or torch.cuda.is_current_stream_capturing():
            return self._sample(hidden)
        size = self._sizes[at]
        assert self._hidden is not None and self._tokens is not None
        self._hidden[:rows].copy_(hidden)
        self._graphs[size].replay()
        # A copy: the next replay overwrites the static output.
        return self._tokens[:rows].clone()
