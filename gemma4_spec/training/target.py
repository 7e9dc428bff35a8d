"""The target: a small text-only Gemma 4 (``Gemma4ForCausalLM``) trained as a GSM8k language model.

Its geometry is the tiny test target's (``gemma4_spec.testing.tiny``: hidden 128, 4 layers
[sliding x3, full], vocab 2048, sliding window 16), which vLLM is known to load.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from gemma4_spec.testing.tiny import target_text_config
from gemma4_spec.training.corpus import length_batches, pad_batch
from gemma4_spec.training.tokenizer import BOS, EOS, PAD

NUM_LAYERS = 4


def target_config(pad_id: int, bos_id: int, eos_ids: Sequence[int]) -> Gemma4TextConfig:
    config = target_text_config(NUM_LAYERS, None, 0)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = pad_id, bos_id, list(eos_ids)
    return config


def new_target(config: Gemma4TextConfig) -> Gemma4ForCausalLM:
    """A freshly initialised target (from the global RNG, which the builder seeds)."""
    model = Gemma4ForCausalLM(config)
    model.to(torch.float32)
    return model


def lm_loss(model: Gemma4ForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the real tokens of a right-padded batch."""
    logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
    labels = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100
    )


def cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(
    model: Gemma4ForCausalLM,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int,
    tokens_per_batch: int,
    lr: float,
    seed: int,
    log_every: int = 20,
) -> list[float]:
    """AdamW with warm-up and cosine decay; returns the loss of every step."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    batches = length_batches(sequences, tokens_per_batch, random.Random(seed))
    pad_id = model.config.pad_token_id
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=max(1, steps // 20))
        ids, mask = pad_batch([sequences[i] for i in next(batches)], pad_id)
        loss = lm_loss(model, ids, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            print(
                f"  target step {step + 1}/{steps}: loss {recent:.3f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    model.eval()
    return losses


__all__ = ["BOS", "EOS", "PAD", "new_target", "target_config", "train_target"]
