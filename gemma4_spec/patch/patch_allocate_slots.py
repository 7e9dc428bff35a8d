"""A decode step's KV slots without vLLM's general bookkeeping when there is nothing to do.

Wraps: ``vllm.v1.core.sched.scheduler.Scheduler.__init__``, to give the scheduler's
``KVCacheManager`` an ``allocate_slots`` of its own (an instance attribute; the class and every
other engine's manager are left alone). vLLM 0.26 and 0.32 (``FAST_ALLOCATE_VLLM``).

Why: the scheduler calls ``allocate_slots`` for every running request on every step. Its general
path visits each KV cache group three times (free the blocks a sliding window left behind, count
the blocks the step needs, allocate them) and then caches the newly full blocks. On a decode step
a request usually needs no new block and has no block leaving its window (a block of 16 to 256
tokens fills once in several steps), yet those visits, over a Gemma 4 target's four groups, are
most of the scheduler's host time, which grows with the batch where the E2B-shaped engines are
host-bound (``benchmarks/results/h200``, ``benchmarks/allocate_slots.py``).

What it does: for the call the scheduler makes for a running request (the request, its token
count and ``num_lookahead_tokens``; any other argument takes vLLM's path), it checks in one pass
over the groups that vLLM's first three visits would change nothing:

* every group has blocks for the request and no prefix-cache copy-on-write pending for it;
* each group's blocks already hold the step's slots (``cdiv(slots, block_size)`` blocks): then
  vLLM counts no block to allocate (with prefix caching on or off) and allocates none;
* no block leaves a window: the last block before the group's skipped tokens is already the null
  block (vLLM frees backwards from there and stops at the first null block), or none is skipped.

Then, with nothing freed or allocated and no free block needed, the only work left in vLLM's
method is caching the full blocks, which it does through the same coordinator call, and the
result is vLLM's empty ``KVCacheBlocks``. Otherwise vLLM's method runs. The checks read the
managers' own ``req_to_blocks``, ``_partial_hit_reqs``, ``get_num_skipped_tokens`` and null block,
and hold for managers whose freeing, counting and allocating are the base classes' (full
attention and sliding window in these versions); a manager or coordinator that overrides any of
them keeps vLLM's path for the whole engine. ``tests/test_allocate_slots.py`` runs engines with
vLLM's method checking every other verdict (sliding windows, prefix caching on and off, chunked
prefill, preemption, async scheduling on a GPU), and a wrong verdict failing that check.

Only engines that draft with gemma4_mtp get it; ``GEMMA4_SPEC_FAST_ALLOCATE=0`` turns it off.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from gemma4_spec.compat import fast_allocate_supported
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp
from gemma4_spec.switches import turned_off

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
FAST_ALLOCATE_ENV = "GEMMA4_SPEC_FAST_ALLOCATE"
# The only keyword the scheduler passes for a running request besides the request and its count.
_RUNNING_KEYWORDS = frozenset({"num_lookahead_tokens"})
# Methods whose base-class bodies the verdict stands for, on the managers and the coordinator
# alike (same names).
_BASE_METHODS = ("remove_skipped_blocks", "get_num_blocks_to_allocate", "allocate_new_blocks")


def apply(scheduler_module: ModuleType) -> None:
    scheduler_cls = scheduler_module.Scheduler
    original = scheduler_cls.__init__
    if is_ours(original):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if (
            drafts_with_gemma4_mtp(self.vllm_config)
            and not turned_off(FAST_ALLOCATE_ENV)
            and fast_allocate_supported()
        ):
            install(self.kv_cache_manager)

    scheduler_cls.__init__ = ours(__init__)


def install(kv_cache_manager: Any) -> None:
    """Give ``kv_cache_manager`` the fast ``allocate_slots`` if its groups allow it."""
    if fast_path_applies(kv_cache_manager):
        kv_cache_manager.allocate_slots = FastAllocateSlots(kv_cache_manager)


def fast_path_applies(kv_cache_manager: Any) -> bool:
    """Whether every manager and the coordinator free, count and allocate with the base
    classes' methods, the ones the verdict was written against."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    coordinator = kv_cache_manager.coordinator
    bases = [(coordinator, KVCacheCoordinator)]
    bases += [(manager, SingleTypeKVCacheManager) for manager in coordinator.single_type_managers]
    return all(
        getattr(type(obj), name) is getattr(base, name)
        for obj, base in bases
        for name in _BASE_METHODS
    )


class FastAllocateSlots:
    """``KVCacheManager.allocate_slots`` for one manager, with the no-op decode step short cut."""

    def __init__(self, kv_cache_manager: Any) -> None:
        from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
        from vllm.v1.request import RequestStatus

        self.kv_cache_manager = kv_cache_manager
        # vLLM's method, bound to this manager.
        self.general = type(kv_cache_manager).allocate_slots.__get__(kv_cache_manager)
        # Each group's manager, and whether its attention skips tokens (a sliding window): only
        # those free blocks while a request runs; the base class counts no skipped token.
        no_skips = SingleTypeKVCacheManager.get_num_skipped_tokens
        self.groups = tuple(
            (manager, type(manager).get_num_skipped_tokens is not no_skips)
            for manager in kv_cache_manager.coordinator.single_type_managers
        )
        self.running = RequestStatus.RUNNING
        # Calls that took the short cut / vLLM's method (benchmarks/allocate_slots.py prints them).
        self.short_cuts = 0
        self.general_calls = 0

    def __call__(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if self.accepts(request, num_new_tokens, args, kwargs):
            self.short_cuts += 1
            return self.cache_and_return(request, num_new_tokens)
        self.general_calls += 1
        return self.general(request, num_new_tokens, *args, **kwargs)

    def accepts(
        self, request: Any, num_new_tokens: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """Whether a call may take the short cut: a running request's call shape, and nothing
        to free or allocate."""
        return (
            not args
            and kwargs.keys() <= _RUNNING_KEYWORDS
            and num_new_tokens > 0
            and self.nothing_to_free_or_allocate(
                request, num_new_tokens, kwargs.get("num_lookahead_tokens", 0)
            )
        )

    def nothing_to_free_or_allocate(
        self, request: Any, num_new_tokens: int, lookahead: int
    ) -> bool:
        """Whether vLLM's method would free no block, need no free block and allocate none."""
        if request.status != self.running:
            return False
        max_model_len = self.kv_cache_manager.max_model_len
        computed = min(request.num_computed_tokens, max_model_len)
        slots = min(computed + num_new_tokens + lookahead, max_model_len)
        # The tokens whose KV no step in flight still reads: where vLLM frees up to.
        processed = max(0, computed - request.num_in_flight_tokens)
        request_id = request.request_id
        for manager, windowed in self.groups:
            blocks = manager.req_to_blocks.get(request_id)
            if blocks is None:
                return False  # no blocks yet: vLLM's path makes the entry
            if request_id in manager._partial_hit_reqs:
                return False  # a copy-on-write block is still to be allocated
            if not self.holds_slots(manager, blocks, slots):
                return False
            if windowed and not self.nothing_leaves_window(manager, blocks, processed):
                return False
        return True

    @staticmethod
    def holds_slots(manager: Any, blocks: list[Any], slots: int) -> bool:
        """Whether ``blocks`` of ``manager``'s group already hold ``slots`` tokens."""
        return -(-slots // manager.block_size) <= len(blocks)

    @staticmethod
    def nothing_leaves_window(manager: Any, blocks: list[Any], processed: int) -> bool:
        """Whether freeing up to ``processed`` tokens frees nothing in ``manager``'s group:
        vLLM frees backwards from the last skipped block and stops at the first null one."""
        skipped = min(manager.get_num_skipped_tokens(processed) // manager.block_size, len(blocks))
        return skipped == 0 or blocks[skipped - 1] is manager._null_block

    def cache_and_return(self, request: Any, num_new_tokens: int) -> Any:
        """What is left of vLLM's method once nothing is freed or allocated."""
        kv_cache_manager = self.kv_cache_manager
        if kv_cache_manager.enable_caching:
            computed = min(request.num_computed_tokens, kv_cache_manager.max_model_len)
            # Only committed tokens are cached, never draft tokens (capped at num_tokens).
            kv_cache_manager.coordinator.cache_blocks(
                request, min(computed + num_new_tokens, request.num_tokens)
            )
        return kv_cache_manager.empty_kv_cache_blocks
