"""What the assistant sees at inference, computed with the target: its training data.

For each GSM8k question, the target's own greedy continuation (so labels are exactly the target's
greedy choices), then one target pass over prompt + continuation giving, at every position ``p``:
the final-normed hidden state (what vLLM's Gemma 4 model returns and our proposer hands to the
assistant), the greedy next token, and the K/V of the last non-KV-shared layer of each attention
type (``return_shared_kv_states``: the caches the assistant's layers read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Gemma4ForCausalLM, GenerationConfig

from gemma4_spec.training.corpus import pad_batch


@dataclass
class FeatureBatch:
    """A right-padded batch of sequences and the target's outputs over them (no gradients)."""

    ids: torch.Tensor  # [B, L] prompt + greedy continuation
    mask: torch.Tensor  # [B, L] real tokens
    anchors: torch.Tensor  # [B, L] positions p drafting starts from: last prompt token onwards
    hidden: torch.Tensor  # [B, L, H] final-normed target hidden state at p
    greedy: torch.Tensor  # [B, L] target's greedy token after position p
    shared_kv: SharedKV


@torch.no_grad()
def greedy_continuations(
    target: Gemma4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    batch_size: int,
) -> list[list[int]]:
    """The target's greedy continuation of each prompt, ``new_tokens`` long; like vLLM with
    ``ignore_eos``, an end token does not stop it (nor is it suppressed)."""
    pad_id = target.config.pad_token_id
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=pad_id,
        bos_token_id=target.config.bos_token_id,
        eos_token_id=None,
    )
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        length = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(chunk):  # left padding, as generation needs
            ids[row, length - len(prompt) :] = torch.tensor(list(prompt))
            mask[row, length - len(prompt) :] = 1
        generated = target.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        out.extend(generated[:, length:].tolist())
    return out


SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> K, V [B, kv, L, d]


@torch.no_grad()
def target_pass(
    target: Gemma4ForCausalLM, seqs: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor, Any, SharedKV]:
    """One pass of the target, without a cache, over ``seqs`` right-padded: (ids, mask, the
    output with its logits and hidden states, the shared K/V the assistant's layers read)."""
    ids, mask = pad_batch(seqs, target.config.pad_token_id)
    out = target(
        input_ids=ids,
        attention_mask=mask.long(),
        use_cache=False,
        output_hidden_states=True,
        return_shared_kv_states=True,
    )
    shared_kv = {name: (k, v) for name, (k, v) in out.shared_kv_states.items()}
    return ids, mask, out, shared_kv


@torch.no_grad()
def target_features(
    target: Gemma4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    batch_size: int,
) -> list[FeatureBatch]:
    """The target's hidden states, greedy tokens and shared K/V over prompt + continuation."""
    batches: list[FeatureBatch] = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(continuations[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        seqs = [list(prompts[i]) + list(continuations[i]) for i in rows]
        ids, mask, out, shared_kv = target_pass(target, seqs)
        anchors = torch.zeros_like(mask)
        for row, i in enumerate(rows):
            anchors[row, len(prompts[i]) - 1 : len(seqs[row])] = True
        batches.append(
            FeatureBatch(
                ids=ids,
                mask=mask,
                anchors=anchors,
                hidden=out.hidden_states[-1],
                greedy=out.logits.argmax(-1),
                shared_kv=shared_kv,
            )
        )
    return batches
