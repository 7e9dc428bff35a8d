"""Greedy verification of a decode batch on Model Runner V2 replayed from one CUDA graph.

Once the target's forward has run, V2's ``GPUModelRunner.sample`` computes the verified rows'
logits and our all-greedy path (``patch/patch_v2_rejection_sampler.py``, and
``patch/patch_v2_sample.py`` for a capped target) turns them into tokens: a gather of the rows'
hidden states, the lm_head GEMM, the argmax (``ops/capped_argmax``), the verification kernel
(``ops/greedy_verify``) and vLLM's count correction, each launched from Python. On the GPU
machine the decode step is bound by the host (``benchmarks/results/h200``), and those launches
and their arguments are host time on every step. Here they are captured once per batch size at
engine start-up and a step replays them: the host copies the step's gathered hidden states and
three small index arrays into the graph's inputs and launches one graph.

A graph serves a decode batch of ``n`` requests that all verify ``k`` drafts (``n (k + 1)``
logits rows), the batch of every step of a running decode. Other batches (a request's first
verification after its prefill, a batch with a request short of drafts) run the eager path.
The batch must pass the same gate as the eager greedy path (greedy requests, nothing that
changes the logits, no grammar); the graph computes what that path computes, from the same
kernels, so its tokens are the eager path's (the GPU engine test compares both with plain
decoding). The per-request arrays the verification reads (prefill lengths; seeds for synthetic
acceptance) live in vLLM's rings of host-mapped buffers, whose current buffer changes at every
update: a step copies the current ones into the graph's own. Graphs are captured for ``n``
from 1 to ``max_num_reqs`` (at most
``MAX_GRAPHED_ROWS`` rows) at start-up, in one memory pool (the logits of the largest batch are
the largest allocation, and the graphs share it), so nothing is captured in a request's path.
On CUDA, one GPU (no tensor or pipeline parallelism), no LoRA, V2;
``GEMMA4_SPEC_GRAPHED_VERIFY=0`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gemma4_spec.log import get_logger

logger = get_logger(__name__)
GRAPHED_VERIFY_ENV = "GEMMA4_SPEC_GRAPHED_VERIFY"
# The largest batch graphed, in logits rows (64 requests at k = 3): the graphs share one memory
# pool that holds the logits of the largest, ``[rows, V]`` (134 MB for Gemma 4's 262144-token
# vocabulary in bfloat16), for as long as the engine runs; larger batches run eagerly.
MAX_GRAPHED_ROWS = 256


@dataclass(frozen=True)
class Persistent:
    """The runner's per-step input buffers a verification reads (the graphs bake in their
    addresses): the step's input ids and positions, the requests' sequence lengths."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor

    def same_as(self, input_batch: Any) -> bool:
        """Whether the step's tensors are views from the start of these buffers."""
        return (
            input_batch.input_ids.data_ptr() == self.input_ids.data_ptr()
            and input_batch.positions.data_ptr() == self.positions.data_ptr()
            and input_batch.seq_lens.data_ptr() == self.seq_lens.data_ptr()
        )


@dataclass(frozen=True)
class Captured:
    """One batch size's graph and the tensors its replay writes."""

    graph: torch.cuda.CUDAGraph
    sampled: torch.Tensor
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor


class VerifyGraphs:
    """The graphs of one runner, by number of requests.

    ``verify(rows, width, logits_indices, cu_num_logits, idx_mapping, *arrays)`` is the
    verification itself, launched over the graph's input tensors (``rows`` the gathered hidden
    states, ``arrays`` copies of what ``request_arrays()`` returns): it returns the sampled
    tokens ``[n, width]`` and each request's sampled and rejected counts.
    ``request_arrays()`` gives the per-request arrays (indexed by request state) as vLLM holds
    them now; they may be other tensors at every call, so ``run`` copies them in.
    """

    def __init__(
        self,
        verify: Any,
        persistent: Persistent,
        request_arrays: Callable[[], tuple[torch.Tensor, ...]],
        max_reqs: int,
        width: int,
        uncapped: bool,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.verify = verify
        self.persistent = persistent
        self.request_arrays = request_arrays
        self.arrays = tuple(torch.zeros_like(a, device=device) for a in request_arrays())
        self.max_reqs = max_reqs
        self.width = width
        self.uncapped = uncapped  # whether ``verify`` computes the logits without the soft-cap
        rows = max_reqs * width
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)
        self.cu_num_logits = torch.arange(max_reqs + 1, dtype=torch.int32, device=device) * width
        self.idx_mapping = torch.arange(max_reqs, dtype=torch.int32, device=device)
        self.graphs: dict[int, Captured] = {}
        self.replays = 0

    def _launch(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = n * self.width
        return self.verify(
            self.hidden[:rows],
            self.width,
            self.logits_indices[:rows],
            self.cu_num_logits[: n + 1],
            self.idx_mapping[:n],
            *self.arrays,
        )

    def capture(self) -> None:
        """Every batch size's graph, the largest first: the graphs share one memory pool, so
        the logits of the largest batch are the pool's largest allocation and every smaller
        graph's logits reuse it (they never replay at once)."""
        pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=main.device)
        for n in range(self.max_reqs, 0, -1):
            self._launch(n)  # compiles what the graph launches, outside the capture
            side.wait_stream(main)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(pool=pool)
                try:
                    sampled, num_sampled, num_rejected = self._launch(n)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
            # Launched once here: CUDA uploads a graph to the device at its first launch, which
            # would otherwise be in the first request of each batch size.
            graph.replay()
            self.graphs[n] = Captured(graph, sampled, num_sampled, num_rejected)

    def run(self, hidden_states: torch.Tensor, input_batch: Any) -> Any:
        """(sampled ``[n, width]``, num_sampled ``[n]``, num_rejected ``[n]``) of the step from
        its graph, fresh tensors; ``None`` where no graph serves the batch."""
        n = input_batch.num_reqs
        captured = self.graphs.get(n)
        indices = input_batch.logits_indices
        if (
            captured is None
            or indices.shape[0] != n * self.width
            or hidden_states.dtype != self.hidden.dtype
            or hidden_states.shape[-1] != self.hidden.shape[-1]
            or not self.persistent.same_as(input_batch)
        ):
            return None
        rows = indices.shape[0]
        torch.index_select(hidden_states, 0, indices, out=self.hidden[:rows])
        self.logits_indices[:rows].copy_(indices)
        self.cu_num_logits[: n + 1].copy_(input_batch.cu_num_logits)
        self.idx_mapping[:n].copy_(input_batch.idx_mapping)
        for mine, current in zip(self.arrays, self.request_arrays(), strict=True):
            mine[: current.shape[0]].copy_(current)  # vLLM may hand a prefix of its buffer
        captured.graph.replay()
        self.replays += 1
        # Copies: the step's output is read on vLLM's copy stream while the next step runs,
        # and the next replay rewrites the graph's own tensors.
        return (
            captured.sampled.clone(),
            captured.num_sampled.clone(),
            captured.num_rejected.clone(),
        )
