"""The fast ``allocate_slots`` (``patch/patch_allocate_slots.py``) against vLLM's own method.

Engines on the shipped tiny pair (sliding-window groups of 64-token blocks over a 16-token window,
a full-attention group of 32-token blocks, so blocks fill and leave the window every few steps)
run with every other call the short cut accepts given to vLLM's method instead, which must then
free and allocate nothing (``testing/allocate_check.py``): with prefix caching and chunked prefill,
and without prefix caching on a KV cache so small that requests are preempted. Their tokens and
the prefix cache they leave must equal an engine's without the short cut. A short cut missing one
of its two checks must be caught by the same check.
"""

from __future__ import annotations

import dataclasses

import pytest
from packaging.version import Version

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.compat import fast_allocate_supported
from gemma4_spec.patch.patch_allocate_slots import FAST_ALLOCATE_ENV, fast_path_applies
from gemma4_spec.testing.allocate_check import SABOTAGES, CheckedRun, run_checked
from gemma4_spec.testing.engine_run import RunConfig

pytestmark = pytest.mark.engine

PROMPTS = [[2] + [100 + (i * 7 + j) % 200 for j in range(20 + 17 * i)] for i in range(6)]
BLOCK_SIZE = 32  # the CPU attention's smallest; the sliding-window groups get 64
# Blocks of the small KV cache: a few requests' worth, so running requests are preempted.
SMALL_CACHE_BLOCKS = 40


def _configs() -> dict[str, RunConfig]:
    import torch

    target, assistant = (str(p) for p in tiny_gsm8k_pair())
    spec = dict(target=target, assistant=assistant, num_speculative_tokens=3)
    # On a GPU: the attention backend of the GPU engine tests (async scheduling runs there).
    gpu = {"attention_config": {"backend": "TRITON_ATTN"}} if torch.cuda.is_available() else {}
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


@pytest.mark.parametrize("sabotage", SABOTAGES)
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
