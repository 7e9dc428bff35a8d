"""GSM8k problems as token sequences in the chat format the pair is served with."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from gemma4_spec.data.gsm8k import Problem
from gemma4_spec.training.tokenizer import END_OF_TURN, chat_prompt


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """Token ids of the chat-formatted question (the template writes the ``<bos>``)."""
    ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
    return list(ids)


def conversation_ids(
    tokenizer: PreTrainedTokenizerBase, problem: Problem, max_len: int
) -> list[int]:
    """Prompt + worked answer + ``<end_of_turn>``, cut to ``max_len`` tokens."""
    text = chat_prompt(tokenizer, problem.question) + problem.answer + END_OF_TURN
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_len]


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, L]`` ids and a bool mask of the real tokens."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = True
    return ids, mask


def length_batches(
    sequences: Sequence[Sequence[int]], tokens_per_batch: int, rng: random.Random
) -> Iterator[list[int]]:
    """Endless batches of indices of similar-length sequences (little padding), in random order.

    Each epoch shuffles, sorts by length within windows of 50 batches' worth, cuts batches of about
    ``tokens_per_batch`` tokens and shuffles the batches."""
    while True:
        order = list(range(len(sequences)))
        rng.shuffle(order)
        batches: list[list[int]] = []
        window = max(1, 50 * tokens_per_batch // 200)
        for start in range(0, len(order), window):
            chunk = sorted(order[start : start + window], key=lambda i: len(sequences[i]))
            batch: list[int] = []
            for idx in chunk:
                longest = max([len(sequences[i]) for i in batch] + [len(sequences[idx])])
                if batch and longest * (len(batch) + 1) > tokens_per_batch:
                    batches.append(batch)
                    batch = []
                batch.append(idx)
            if batch:
                batches.append(batch)
        rng.shuffle(batches)
        yield from batches
