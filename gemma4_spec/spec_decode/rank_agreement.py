"""One decision for every tensor-parallel rank, where a rank alone could decide otherwise.

Under tensor parallelism every rank captures and replays its own whole-loop draft graphs
(``draft_graphs.py``), and the all-reduces inside them (o_proj, down_proj, the target's
vocab-parallel embedding) pair each rank's graph with its peers':

* vLLM's custom all-reduce, while vLLM captures (our captures run inside its
  ``graph_capture``), records each graph's all-reduce inputs and, at the end of the capture,
  exchanges their IPC handles: rank r's i-th recorded buffer is paired with every peer's i-th.
  A rank that skips a capture its peers make shifts that pairing for every later graph.
* At replay, a rank that drafts step by step while its peers replay a graph runs the eager
  all-reduce against their registered one: each reads memory the other did not write (and,
  once the skipping rank has freed its graphs, memory that is no longer its).

So whether a capture is attempted, and whether its graphs are kept, is agreed across the ranks:
a failure on one rank is every rank's failure. What a failure inside the capture itself has
already recorded on the failing rank cannot be undone (vLLM's own graphs share that limit).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def tensor_parallel_cpu_group() -> Any | None:
    """vLLM's CPU process group of this rank's tensor-parallel ranks, or None with one rank
    (or outside a vLLM worker)."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    group = get_tp_group()
    return group.cpu_group if group.world_size > 1 else None


def first_failure(reason: str | None, group: Any | None) -> str | None:
    """Every rank's ``reason`` not to go on (None: this rank can), gathered over the CPU process
    ``group``: the same answer on every rank, the lowest failing rank's reason naming that rank,
    or None when every rank can. Without a group, ``reason`` itself. Every rank of the group
    must call it at the same point."""
    if group is None:
        return reason
    reasons: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    for rank, failed in enumerate(reasons):
        if failed is not None:
            return f"{failed} (on tensor-parallel rank {rank})"
    return None
