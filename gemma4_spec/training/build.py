"""The whole recipe of the shipped GSM8k pair (``gemma4-spec build-gsm8k-pair``).

1. a byte-level BPE tokenizer on GSM8k train text, with a Gemma-style chat template;
2. the target, a small Gemma 4, trained as a language model on chat-formatted train problems;
3. its greedy continuations of other train questions, and its hidden states and shared K/V
   over them (the assistant's inputs at inference);
4. the assistant trained on the unrolled draft steps with full-vocabulary logits; then its lm_head
   rows clustered (balanced k-means) into ``token_ordering``, the centroids started at the cluster
   means, and both trained further with the centroid head's loss added.

Everything is seeded and runs on a fixed number of threads, so a seed gives the same pair on the
same machine and library versions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

from gemma4_spec.data import gsm8k
from gemma4_spec.testing.config_format import write_portable_config
from gemma4_spec.testing.tiny import VOCAB_SIZE
from gemma4_spec.training.assistant import (
    draft_accuracy,
    init_centroids,
    new_assistant,
    train_assistant,
)
from gemma4_spec.training.clustering import balanced_kmeans
from gemma4_spec.training.corpus import conversation_ids, prompt_ids
from gemma4_spec.training.features import greedy_continuations, target_features
from gemma4_spec.training.target import new_target, target_config, train_target
from gemma4_spec.training.tokenizer import END_OF_TURN, train_tokenizer

BUILD_THREADS = 2
MAX_TRAIN_LEN = 320  # tokens of prompt + answer (longest GSM8k train problem: ~570, mean ~190)
NUM_DRAFT_STEPS = 3  # draft steps unrolled in training: num_speculative_tokens the pair targets


@dataclass(frozen=True)
class Budget:
    """How much work each stage does; the defaults build the shipped pair."""

    target_steps: int = 300
    target_tokens_per_batch: int = 4096
    target_lr: float = 1e-2
    distill_prompts: int = 384
    distill_new_tokens: int = 96
    generate_batch: int = 128
    features_batch: int = 16
    assistant_steps: int = 300
    centroid_steps: int = 60
    assistant_lr: float = 3e-3
    clustering_iterations: int = 6


def build_pair(
    out: str | Path, *, gsm8k_folder: str | None = None, seed: int = 0, budget: Budget = Budget()
) -> tuple[Path, Path]:
    """Write ``out/target`` (with the tokenizer) and ``out/assistant``; returns both paths."""
    out = Path(out)
    problems = gsm8k.load("train", folder=gsm8k_folder)  # a clear error if GSM8k is missing
    if len(problems) < budget.distill_prompts + 1:
        raise ValueError(f"GSM8k train has {len(problems)} problems, too few for this budget")
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _build(out, problems, seed, budget)
    finally:
        torch.set_num_threads(threads)


def _stage(name: str, start: float) -> None:
    print(f"[build-gsm8k-pair] {name} ({time.perf_counter() - start:.0f} s)", flush=True)


def _build(
    out: Path, problems: list[gsm8k.Problem], seed: int, budget: Budget
) -> tuple[Path, Path]:
    start = time.perf_counter()
    tokenizer = train_tokenizer([p.question + "\n" + p.answer for p in problems], VOCAB_SIZE)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    eos_ids = [tokenizer.eos_token_id, end_of_turn]
    _stage("tokenizer trained", start)

    # The target learns from every train problem but the last distill_prompts, whose questions
    # it then answers for the assistant's training data.
    lm_problems = problems[: len(problems) - budget.distill_prompts]
    distill_problems = problems[len(problems) - budget.distill_prompts :]
    config = target_config(tokenizer.pad_token_id, tokenizer.bos_token_id, eos_ids)
    target = new_target(config)
    train_target(
        target,
        [conversation_ids(tokenizer, p, MAX_TRAIN_LEN) for p in lm_problems],
        steps=budget.target_steps,
        tokens_per_batch=budget.target_tokens_per_batch,
        lr=budget.target_lr,
        seed=seed,
    )
    _stage("target trained", start)

    prompts = [prompt_ids(tokenizer, p.question) for p in distill_problems]
    continuations = greedy_continuations(
        target, prompts, budget.distill_new_tokens, budget.generate_batch
    )
    batches = target_features(target, prompts, continuations, budget.features_batch)
    # A few batches kept for the accuracy estimate (tiny budgets with one batch train on it too).
    held_out = batches[len(batches) // 2 :: 8]
    train_batches = [b for b in batches if all(b is not h for h in held_out)] or batches
    _stage(f"target's greedy continuations and features ({len(batches)} batches)", start)

    assistant = new_assistant(config)
    embed = target.get_input_embeddings()
    common = dict(lr=budget.assistant_lr, num_steps=NUM_DRAFT_STEPS, seed=seed)
    train_assistant(assistant, embed, train_batches, steps=budget.assistant_steps, **common)
    head = assistant.masked_embedding
    assert head is not None
    rows = assistant.lm_head.weight.detach()
    # A direction common to all rows shifts every logit alike (no argmax changes) but dominates
    # the rows' cosines: cluster what tells tokens apart.
    ordering, _ = balanced_kmeans(
        rows - rows.mean(0),
        head.num_centroids,
        iterations=budget.clustering_iterations,
        generator=torch.Generator().manual_seed(seed),
    )
    cluster_of = init_centroids(assistant, ordering)
    train_assistant(
        assistant,
        embed,
        train_batches,
        steps=budget.centroid_steps,
        cluster_of=cluster_of,
        **common,
    )
    accuracy = draft_accuracy(assistant, embed, held_out, NUM_DRAFT_STEPS)
    _stage(
        "assistant trained; held-out draft accuracy per step (teacher-forced, centroid-masked): "
        + ", ".join(f"{a:.2f}" for a in accuracy),
        start,
    )
    return _save(out, tokenizer, target, assistant, eos_ids)


def _save(
    out: Path,
    tokenizer: PreTrainedTokenizerFast,
    target: Gemma4ForCausalLM,
    assistant: Gemma4AssistantForCausalLM,
    eos_ids: list[int],
) -> tuple[Path, Path]:
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_ids,
    )
    paths = out / "target", out / "assistant"
    for model, path in zip((target, assistant), paths, strict=True):
        path.mkdir(parents=True, exist_ok=True)
        model.generation_config = generation
        model.save_pretrained(path)
        write_portable_config(path)  # readable by every transformers the vLLM range uses
        tokenizer.save_pretrained(path)
    return paths
