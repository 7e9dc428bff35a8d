"""Engine runs that check the fast ``allocate_slots`` (``patch/patch_allocate_slots.py``) against
vLLM's own method on every call it would short-cut.

In a checked run, each call the short cut accepts is, every other time, given to vLLM's method
instead, on the real state, which must then free nothing, allocate nothing and return vLLM's empty
blocks (the short cut's claim); the calls in between take the short cut, so the engine also runs
on its results. A sabotaged run drops one of the short cut's checks and gives every accepted call
to vLLM's method: its wrong verdicts must show up as mismatches (the control of the check).
``run_checked`` runs configurations in a fresh process (vLLM's single-process mode).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemma4_spec.patch import patch_allocate_slots
from gemma4_spec.patch.patch_allocate_slots import FastAllocateSlots
from gemma4_spec.testing.engine_run import RunConfig, generate, run_json_module


class _NoSlotsCheck(FastAllocateSlots):
    """The short cut without its check that the blocks hold the step's slots."""

    holds_slots = staticmethod(lambda manager, blocks, slots: True)


class _NoWindowCheck(FastAllocateSlots):
    """The short cut without its check that no block leaves a window."""

    nothing_leaves_window = staticmethod(lambda manager, blocks, processed: True)


# Sabotaged short cuts by the check they drop: the controls of the checks.
SABOTAGED: dict[str, type[FastAllocateSlots]] = {"slots": _NoSlotsCheck, "window": _NoWindowCheck}


@dataclass
class AllocateCounts:
    # Short cuts checked against vLLM's method / taken / vLLM's method called for the rest.
    checked: int = 0
    taken: int = 0
    general: int = 0
    # Checked short cuts where vLLM's method freed or allocated blocks: (request, what differed).
    mismatches: list[str] = field(default_factory=list)
    # Calls of vLLM's method (outside the checks) that freed or allocated blocks.
    general_changes: int = 0
    # Prefix-cache lookups (one a request admitted: more than the requests means preemption),
    # and the blocks the prefix cache holds at the end.
    lookups: int = 0
    cached_blocks: int = 0
    # The most tokens in flight a request had (async scheduling), and whether the fast
    # ``allocate_slots`` was installed.
    max_in_flight_tokens: int = 0
    installed: bool = False


@dataclass
class CheckedRun:
    token_ids: list[list[int]]
    counts: AllocateCounts


_counts = AllocateCounts()
# The scheduler's KV cache manager of the run going on.
_manager: Any = None


def _state(kv_cache_manager: Any, request_id: str) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """Free blocks, and the request's block ids in each group."""
    return kv_cache_manager.block_pool.get_num_free_blocks(), tuple(
        tuple(block.block_id for block in manager.req_to_blocks.get(request_id, ()))
        for manager in kv_cache_manager.coordinator.single_type_managers
    )


def install_check(sabotage: str | None) -> None:
    """Replace ``FastAllocateSlots.__call__`` with the checking one, and count admissions."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if sabotage is not None:
        if sabotage not in SABOTAGED:
            raise ValueError(f"sabotage {sabotage!r} is not one of {list(SABOTAGED)}")
        # What the scheduler's patch installs from now on (it inherits the checking call).
        patch_allocate_slots.FastAllocateSlots = SABOTAGED[sabotage]  # type: ignore[misc]

    def checked_call(
        self: FastAllocateSlots, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        _counts.installed = True
        _counts.max_in_flight_tokens = max(
            _counts.max_in_flight_tokens, request.num_in_flight_tokens
        )
        manager = self.kv_cache_manager
        accepted = self.accepts(request, num_new_tokens, args, kwargs)
        if accepted and (sabotage is None and (_counts.checked + _counts.taken) % 2 == 1):
            _counts.taken += 1
            return self.cache_and_return(request, num_new_tokens)
        before = _state(manager, request.request_id)
        result = self.general(request, num_new_tokens, *args, **kwargs)
        after = _state(manager, request.request_id)
        changed = result is not manager.empty_kv_cache_blocks or before != after
        if accepted:
            _counts.checked += 1
            if changed:
                _counts.mismatches.append(f"{request.request_id}: {before} -> {after}")
        else:
            _counts.general += 1
            _counts.general_changes += changed
        return result

    FastAllocateSlots.__call__ = checked_call  # type: ignore[method-assign]

    original_lookup = KVCacheManager.get_computed_blocks

    def get_computed_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        global _manager
        _manager = self
        _counts.lookups += 1
        return original_lookup(self, request, *args, **kwargs)

    KVCacheManager.get_computed_blocks = get_computed_blocks  # type: ignore[method-assign]


def run_checked(
    configs: list[RunConfig],
    *,
    sabotage: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 1200,
) -> list[CheckedRun]:
    """Each config's run, checked, in one new interpreter (in order)."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    payload = {"configs": [asdict(c) for c in configs], "sabotage": sabotage}
    data = run_json_module(__name__, payload, env=child_env, timeout=timeout, what="checked run")
    return [CheckedRun(d["token_ids"], AllocateCounts(**d["counts"])) for d in data]


def _main(request: str, response: str) -> None:
    global _counts
    spec = json.loads(Path(request).read_text())
    install_check(spec["sabotage"])
    runs = []
    for config in spec["configs"]:
        _counts = AllocateCounts()
        result = generate(RunConfig(**config), single_process=True)
        _counts.cached_blocks = len(_manager.block_pool.cached_block_hash_to_block)
        runs.append({"token_ids": result.token_ids, "counts": asdict(_counts)})
    Path(response).write_text(json.dumps(runs))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
