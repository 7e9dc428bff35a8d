"""Tensor parallelism on two GPUs: ``tensor_parallel_size=2`` with CUDA graphs on, float32,
greedy: our output equals plain decoding's at TP=2, on both model runners, for

* an E2B-shaped random pair (``testing/e2b_shaped.py``: the published widths, centroid head);
* the tiny 31B-shaped pair (``testing/families.py``: K = V full-attention layers with one KV
  head, replicated on both ranks; a full-vocabulary head, no centroids).

Ours on one GPU runs beside them and its agreement is reported, not asserted: float32 sums split
over two ranks round differently from one rank's, so a near-tie may part (plain at TP=2 is the
reference for losslessness; the CPU test ``test_engine_tp.py`` asserts the TP=1 equality where
the pair's logits have no such ties).

NVLink multicast stays off in every engine process (the GPU machine's rule: a program that uses
it can put shared GPUs out of service): NCCL's, PyTorch's and NVSHMEM's, and vLLM's
symmetric-memory all-reduce. Skipped without two CUDA GPUs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from gemma4_spec.testing.engine_run import (
    PLUGIN_DRAFT_MODEL,
    RunResult,
    gpu_run_fields,
    run_tensor_parallel_three_ways,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

TP = 2
K = 3
MAX_TOKENS = 32
PROMPT_LENGTHS = (5, 21, 40)  # two of them past the tiny pair's sliding window
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}
RUNNERS = {"V1": "0", "V2": "1"}
PAIRS = ("e2b", "31b")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    from gemma4_spec.testing.e2b_shaped import build_e2b_shaped_pair
    from gemma4_spec.testing.families import build_family_pair

    root = tmp_path_factory.mktemp("gpu-tp")
    return {
        "e2b": build_e2b_shaped_pair(root / "e2b"),
        "31b": build_family_pair("31b", root / "31b"),
    }


@pytest.fixture(scope="module")
def runs(pairs: dict[str, tuple[Path, Path]]) -> dict[tuple[str, str], dict[str, RunResult]]:
    out = {}
    for name, (target, assistant) in pairs.items():
        vocab = AutoConfig.from_pretrained(target).get_text_config().vocab_size
        rng = random.Random(21)
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
        common = gpu_run_fields(str(target), prompts, MAX_TOKENS)
        for runner, flag in RUNNERS.items():  # each runner in a process of its own
            out[name, runner] = run_tensor_parallel_three_ways(
                common,
                str(assistant),
                tensor_parallel_size=TP,
                num_speculative_tokens=K,
                env={**MULTICAST_OFF, "VLLM_USE_V2_MODEL_RUNNER": flag},
            )
    return out


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("pair", PAIRS)
def test_tp2_greedy_output_equals_plain_tp2(
    runs: dict[tuple[str, str], dict[str, RunResult]],
    pair: str,
    runner: str,
    report_figure: Callable[[str], None],
) -> None:
    three = runs[pair, runner]
    plain, ours, single = three["plain-tp"], three["ours-tp"], three["ours-tp1"]
    assert ours.draft_model_class == PLUGIN_DRAFT_MODEL
    assert len(ours.rank_facts) == TP
    assert all(len(tokens) == MAX_TOKENS for tokens in ours.token_ids)
    assert ours.token_ids == plain.token_ids
    assert ours.spec_metrics["vllm:spec_decode_num_drafts"] > 0
    same = sum(a == b for a, b in zip(ours.token_ids, single.token_ids, strict=True))
    report_figure(
        f"{pair} {runner}: ours TP=2 equals plain TP=2; ours TP=1 equal on {same} of "
        f"{len(ours.token_ids)} prompts; accepted {ours.acceptance.num_accepted_tokens} of "
        f"{ours.acceptance.num_draft_tokens} drafts (TP=1: {single.acceptance.num_accepted_tokens})"
    )
