"""Where each request's next drafting starts, as the proposer's answers to the V1 runner.

After verification the runner calls the drafter's ``prepare_next_token_ids_padded`` (each
request's next token and kept-token count) and ``prepare_inputs_padded`` (each request's row
of its last kept token, its rejected count, and the target step's metadata as the drafter
sees it). vLLM's base class answers each with a Triton launch from Python and some host tensor
work; ``DraftStart`` answers both with ``ops/verify_outcome.py``, whose launches replay from
CUDA graphs into fixed outputs. Same values as vLLM's (tested against its methods).

The outputs live in two alternating sets of buffers: the runner keeps a step's next tokens (as
the next step's carried tokens) and its kept counts (copied to the host on a side stream)
into the following step, while that step writes the other set.
``GEMMA4_SPEC_DRAFT_START=0`` keeps vLLM's methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from gemma4_spec.ops.graphed_launch import GraphedLaunches
from gemma4_spec.ops.verify_outcome import draft_rows, next_tokens

DRAFT_START_ENV = "GEMMA4_SPEC_DRAFT_START"

# The fields of the runner's metadata that the drafter's view keeps (as vLLM's base class
# does); the others take their defaults. Those this vLLM does not have are skipped.
_KEPT_FIELDS = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "_seq_lens_cpu",
    "_num_computed_tokens_cpu",
    "seq_lens_cpu_upper_bound",
    "num_reqs",
    "max_seq_len",
    "block_table_tensor",
    "dcp_local_seq_lens",
)


class DraftStart:
    """One proposer's output buffers and graphed launches."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        def buffers() -> tuple[torch.Tensor, ...]:
            return tuple(
                torch.zeros(max_batch_size, dtype=torch.int32, device=device) for _ in range(4)
            )

        self._sets = (buffers(), buffers())  # (next, kept, row, rejected), twice
        self._current = 1
        # Views of the first B rows of each set, made once per (set, B): slicing costs the host.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.next_launches = GraphedLaunches("next-token selection", max_graphs=8)
        self.row_launches = GraphedLaunches("draft-row selection", max_graphs=8)
        init = {f.name for f in dataclasses.fields(CommonAttentionMetadata) if f.init}
        self._kept_fields = tuple(name for name in _KEPT_FIELDS if name in init)
        self.calls = 0

    def next_tokens(
        self,
        sampled: torch.Tensor,
        requests: dict[str, Any],
        batch: Any,
        discard: torch.Tensor,
        backup: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next token ids, kept-token counts) ``[B]`` of ``sampled [B, 1 + k]``. ``backup``
        is the base class's host/device buffer for each request's last known token."""
        b = sampled.shape[0]
        if b > self._sets[0][0].shape[0]:
            raise ValueError(f"{b} requests exceed the drafter's maximum batch")
        self.calls += 1
        self._current ^= 1
        nxt, kept = self._sets[self._current][:2]
        num_reqs = batch.num_reqs
        # Each request's last known token (used where a request is discarded).
        last = batch.num_tokens_no_spec[:num_reqs].tolist()
        backup.np[:num_reqs] = [
            requests[r].get_token_id(n - 1)
            for r, n in zip(batch.req_ids[:num_reqs], last, strict=True)
        ]
        backup.copy_to_gpu(num_reqs)
        next_tokens(sampled, discard, backup.gpu, batch.vocab_size, nxt, kept, self.next_launches)
        return self._first(b)[:2]

    def _first(self, b: int) -> tuple[torch.Tensor, ...]:
        """The current set's buffers, first ``b`` rows."""
        key = (self._current, b)
        views = self._views.get(key)
        if views is None:
            views = tuple(t[:b] for t in self._sets[self._current])
            self._views[key] = views
        return views

    def rows(
        self,
        common: CommonAttentionMetadata,
        cu_num_draft_tokens: torch.Tensor,
        kept: torch.Tensor,
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        """(the drafter's view of the target step's metadata, each request's last kept row,
        its rejected count) after ``next_tokens`` gave ``kept``."""
        n = common.num_reqs
        row, rejected = self._sets[self._current][2:]
        draft_rows(
            cu_num_draft_tokens, kept, common.query_start_loc, n, row, rejected, self.row_launches
        )
        starts = common.query_start_loc_cpu.numpy()
        total = int(starts[-1])
        view = CommonAttentionMetadata(
            **{name: getattr(common, name) for name in self._kept_fields},
            num_actual_tokens=total,
            max_query_len=int((starts[1:] - starts[:-1]).max()),
            slot_mapping=common.slot_mapping[:total],
            causal=True,
        )
        first = self._first(n)
        return view, first[2], first[3]
