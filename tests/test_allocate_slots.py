"""The fast ``allocate_slots`` (``patch/patch_allocate_slots.py``) against vLLM's own method.

Engines on the shipped tiny pair (sliding-window groups of 64-token blocks over a 16-token window,
a full-attention group of 32-token blocks, so blocks fill and leave the window every few steps)
run with every other call the short cut accepts given to vLLM's method instead, which must then
free and allocate nothing (``testing/allocate_check.py``): with prefix caching and chunked prefill,
and without prefix caching on a KV cache so small that requests are preempted. Their tokens and
the prefix cache they leave must equal an engine's without the short cut. A short cut missing one
of its two checks must be caught by the same check.

Without an engine, vLLM's KV cache manager (a full-attention and a sliding-window group) is driven
through random decode sequences (random drafts and acceptance, tokens in flight as with async
scheduling, preemption, prefix caching on and off), the verdict checked on every call.
"""

from __future__ import annotations

import dataclasses

import pytest
from packaging.version import Version

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.compat import fast_allocate_supported
from gemma4_spec.patch.patch_allocate_slots import (
    FAST_ALLOCATE_ENV,
    FastAllocateSlots,
    fast_path_applies,
)
from gemma4_spec.testing.allocate_check import SABOTAGED, CheckedRun, run_checked
from gemma4_spec.testing.engine_run import RunConfig, gpu_attention

pytestmark = pytest.mark.engine

PROMPTS = [[2] + [100 + (i * 7 + j) % 200 for j in range(20 + 17 * i)] for i in range(6)]
BLOCK_SIZE = 32  # the CPU attention's smallest; the sliding-window groups get 64
# Blocks of the small KV cache: a few requests' worth, so running requests are preempted.
SMALL_CACHE_BLOCKS = 40


def _configs() -> dict[str, RunConfig]:
    target, assistant = (str(p) for p in tiny_gsm8k_pair())
    spec = dict(target=target, assistant=assistant, num_speculative_tokens=3)
    # On a GPU: the attention backend of the GPU engine tests (async scheduling runs there).
    gpu = gpu_attention()
    return {
        # The prompts twice (the second batch after the first has finished), prefilled in
        # chunks of 64 tokens.
        "prefix-caching": RunConfig(
            **spec,
            prompts=PROMPTS + PROMPTS,
            request_batches=[len(PROMPTS), len(PROMPTS)],
            max_tokens=150,
            max_model_len=512,
            extra_engine_kwargs=dict(
                block_size=BLOCK_SIZE,
                max_num_batched_tokens=64,
                enable_prefix_caching=True,
                **gpu,
            ),
        ),
        "preemption": RunConfig(
            **spec,
            prompts=PROMPTS,
            max_tokens=140,
            max_model_len=256,
            extra_engine_kwargs=dict(
                block_size=BLOCK_SIZE,
                enable_prefix_caching=False,
                num_gpu_blocks_override=SMALL_CACHE_BLOCKS,
                **gpu,
            ),
        ),
    }


@pytest.fixture(scope="module")
def checked() -> dict[str, CheckedRun]:
    configs = _configs()
    return dict(zip(configs, run_checked(list(configs.values())), strict=True))


@pytest.fixture(scope="module")
def without_short_cut() -> dict[str, CheckedRun]:
    configs = _configs()
    runs = run_checked(list(configs.values()), env={FAST_ALLOCATE_ENV: "0"})
    return dict(zip(configs, runs, strict=True))


@pytest.mark.parametrize("name", ["prefix-caching", "preemption"])
def test_short_cut_frees_and_allocates_what_vllm_would(
    checked: dict[str, CheckedRun], name: str, report_figure
) -> None:
    counts = checked[name].counts
    assert counts.installed
    assert counts.mismatches == []
    # Both halves ran: calls checked against vLLM's method and calls that took the short cut,
    # besides vLLM's own calls that did free or allocate blocks.
    assert counts.checked > 100 and counts.taken > 100
    assert counts.general_changes > 50
    report_figure(
        f"{name}: {counts.checked + counts.taken} short cuts, {counts.general} calls of vLLM's "
        f"method ({counts.general_changes} of them changed blocks), up to "
        f"{counts.max_in_flight_tokens} tokens in flight"
    )


def test_scenarios_reach_what_they_are_for(checked: dict[str, CheckedRun]) -> None:
    assert checked["prefix-caching"].counts.cached_blocks > 0
    # More admissions than requests: running requests were preempted and came back.
    assert checked["preemption"].counts.lookups > len(PROMPTS)


@pytest.mark.parametrize("name", ["prefix-caching", "preemption"])
def test_same_tokens_and_cache_as_vllms_method(
    checked: dict[str, CheckedRun], without_short_cut: dict[str, CheckedRun], name: str
) -> None:
    ours, vllms = checked[name], without_short_cut[name]
    assert not vllms.counts.installed
    assert ours.token_ids == vllms.token_ids
    assert ours.counts.cached_blocks == vllms.counts.cached_blocks
    assert ours.counts.lookups == vllms.counts.lookups


@pytest.mark.parametrize("sabotage", SABOTAGED)
def test_check_catches_a_short_cut_missing_a_check(sabotage: str) -> None:
    (run,) = run_checked([_configs()["preemption"]], sabotage=sabotage)
    assert run.counts.mismatches, f"a short cut without its {sabotage} check went unnoticed"


def test_plain_engine_keeps_vllms_method() -> None:
    config = _configs()["preemption"]
    (run,) = run_checked([dataclasses.replace(config, assistant=None)])
    assert not run.counts.installed


def test_only_where_the_managers_are_the_base_classes() -> None:
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        SlidingWindowManager,
    )

    class OwnFreeing(SlidingWindowManager):
        def remove_skipped_blocks(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return None

    class FakeKVCacheManager:
        def __init__(self, *managers: type) -> None:
            self.coordinator = object.__new__(HybridKVCacheCoordinator)
            self.coordinator.single_type_managers = [object.__new__(m) for m in managers]

    assert fast_path_applies(FakeKVCacheManager(FullAttentionManager, SlidingWindowManager))
    assert not fast_path_applies(FakeKVCacheManager(FullAttentionManager, OwnFreeing))


def test_versions() -> None:
    assert fast_allocate_supported(Version("0.26.0"))
    assert fast_allocate_supported(Version("0.32.0"))
    assert not fast_allocate_supported(Version("0.29.0"))
    assert not fast_allocate_supported(Version("0.33.0"))


# Without an engine: vLLM's KV cache manager driven through random decode sequences, with the
# short cut's verdict checked against vLLM's method on every running request's call. This is
# where tokens in flight (async scheduling, GPU only in the engine runs) are exercised on CPU.

BLOCK = 16
WINDOW = 40  # not a multiple of the block: the window's edge moves inside blocks


def _manager(caching: bool, num_blocks: int):  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = dict(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(["window"], SlidingWindowSpec(**shape, sliding_window=WINDOW)),
    ]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=2048,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=caching,
    )


def _random_decoding(
    checker: type[FastAllocateSlots], *, seed: int, caching: bool, in_flight: bool
) -> dict[str, int]:
    """Requests admitted, decoded with k=3 drafts and random acceptance, preempted when blocks
    run out, finished; the checker's verdict on every running request's call against vLLM's
    method. Returns what happened."""
    import random

    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    rng = random.Random(seed)
    k = 3
    manager = _manager(caching, num_blocks=80)  # a few requests' worth: preemptions
    fast = checker(manager)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    shared = [rng.randrange(1, 1000) for _ in range(48)]  # a common prefix: prefix-cache hits
    waiting = [
        Request(
            f"r{i}",
            shared[: rng.randrange(0, 48)]
            + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 60))],
            SamplingParams(max_tokens=400),
            None,
            block_hasher=hasher,
        )
        for i in range(24)
    ]
    lengths = {r.request_id: rng.randrange(60, 400) for r in waiting}  # output tokens each
    running: list[Request] = []
    pending: dict[str, tuple[int, int]] = {}  # the step in flight: (tokens scheduled, drafts)
    seen = {"verdicts": 0, "short": 0, "mismatches": 0, "changed": 0, "preempted": 0}

    def state(request: Request) -> tuple[int, tuple[tuple[int, ...], ...]]:
        return manager.block_pool.get_num_free_blocks(), tuple(
            tuple(b.block_id for b in m.req_to_blocks.get(request.request_id, ()))
            for m in manager.coordinator.single_type_managers
        )

    def resolve(request: Request) -> None:
        """The step in flight comes back: its rejected drafts are rolled back."""
        scheduled, drafts = pending.pop(request.request_id)
        accepted = rng.randint(0, drafts)
        request.num_computed_tokens -= drafts - accepted
        request.append_output_token_ids([rng.randrange(1, 1000) for _ in range(accepted + 1)])
        request.num_in_flight_tokens = 0

    def preempt(request: Request) -> None:
        if request.request_id in pending:
            resolve(request)
        manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        running.remove(request)
        waiting.insert(0, request)
        seen["preempted"] += 1

    for _ in range(3000):
        if not running and not waiting:
            break
        if waiting and len(running) < 8 and rng.random() < 0.5:
            request = waiting[0]
            hit_blocks, hit_tokens, *_ = manager.get_computed_blocks(request)
            blocks = manager.allocate_slots(
                request,
                request.num_tokens - hit_tokens,
                hit_tokens,
                hit_blocks,
                num_lookahead_tokens=k,
            )
            if blocks is not None:
                waiting.pop(0)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = request.num_tokens
                running.append(request)
        for request in list(running):
            if request not in running:
                continue
            if not in_flight and request.request_id in pending:
                resolve(request)
            drafts = rng.randint(0, k)
            scheduled = 1 + drafts
            verdict = fast.nothing_to_free_or_allocate(request, scheduled, k)
            before = state(request)
            blocks = fast.general(request, scheduled, num_lookahead_tokens=k)
            changed = blocks is not manager.empty_kv_cache_blocks or state(request) != before
            seen["verdicts"] += 1
            seen["short"] += verdict
            seen["mismatches"] += verdict and changed
            seen["changed"] += changed
            if blocks is None:
                preempt(request)
                continue
            if request.request_id in pending:  # async: last step's outcome arrives now
                resolve(request)
            request.num_computed_tokens += scheduled
            pending[request.request_id] = (scheduled, drafts)
            request.num_in_flight_tokens = scheduled if in_flight else 0
            if request.num_output_tokens >= lengths[request.request_id]:
                if request.request_id in pending:
                    resolve(request)
                manager.free(request)
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                running.remove(request)
    return seen


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
@pytest.mark.parametrize("in_flight", [True, False], ids=["async", "sync"])
def test_verdicts_match_vllm_on_random_decoding(caching: bool, in_flight: bool) -> None:
    for seed in range(3):
        seen = _random_decoding(FastAllocateSlots, seed=seed, caching=caching, in_flight=in_flight)
        assert seen["mismatches"] == 0, seen
        # Both verdicts were reached, vLLM's calls changed blocks, and requests were preempted.
        assert seen["short"] > seen["verdicts"] // 2, seen
        assert seen["changed"] > 100 and seen["preempted"] > 0, seen


@pytest.mark.parametrize("sabotage", SABOTAGED)
def test_random_decoding_catches_a_missing_check(sabotage: str) -> None:
    seen = _random_decoding(SABOTAGED[sabotage], seed=0, caching=True, in_flight=True)
    assert seen["mismatches"] > 0, seen
