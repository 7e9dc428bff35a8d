"""The assistant: a ``Gemma4AssistantForCausalLM`` trained to draft the target's greedy tokens.

Training reproduces the inputs of our vLLM proposer exactly. For a request whose last accepted
position is ``p``:

* step 1 feeds ``(target_embed(t_{p+1}) * sqrt(H), h_p)``: the target's new token, embedded and
  scaled by the target, and the target's final-normed hidden state at ``p``;
* step ``s > 1`` feeds the previous draft token and the assistant's own ``post_projection``
  output of step ``s - 1``;
* every step queries at position ``p`` over the target's K/V of positions ``0..p``.

(transformers' own assisted generation queries at ``p + 1``; we train for our convention.) Since
every step's queries sit at the anchor positions, one step for all anchors of a sequence at once
is the assistant's causal forward over the whole sequence with the target's K/V as its cache. Step
``s`` is trained teacher-forced on the token (a draft only matters if the drafts before it were
right, i.e. equal to the target's tokens) but on the assistant's own hidden state, and predicts
the target's greedy token after ``x_{p+s}``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import torch
from torch import nn
from transformers import Gemma4AssistantForCausalLM, Gemma4TextConfig

from gemma4_spec.testing.tiny import assistant_config_for
from gemma4_spec.training.features import FeatureBatch
from gemma4_spec.training.target import cosine_lr


def new_assistant(target_config: Gemma4TextConfig) -> Gemma4AssistantForCausalLM:
    """A fresh assistant with centroid masking, geometry as the tiny test assistant's."""
    model = Gemma4AssistantForCausalLM(assistant_config_for(target_config, centroids=True))
    model.to(torch.float32)
    return model


def _shifted(values: torch.Tensor, shift: int, fill: int | bool) -> torch.Tensor:
    """``values[:, p + shift]`` at column p (``fill`` past the end)."""
    out = torch.full_like(values, fill)
    out[:, : values.shape[1] - shift] = values[:, shift:]
    return out


def draft_step(
    assistant: Gemma4AssistantForCausalLM,
    token_embeds: torch.Tensor,
    hidden: torch.Tensor,
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step with a query at every position p over the target's K/V of 0..p.

    Returns (draft-width normed hidden, the lm_head's input; backbone-width next hidden)."""
    x = assistant.pre_projection(torch.cat([token_embeds, hidden], dim=-1))
    # No attention mask: the text model builds the causal (and sliding-window) masks of a
    # sequence at positions 0..L-1, with the shared K/V as the keys; right padding never reaches
    # a real query.
    h = assistant.model(inputs_embeds=x, shared_kv_states=shared_kv, use_cache=False)
    draft_hidden = h.last_hidden_state
    return draft_hidden, assistant.post_projection(draft_hidden)


def unrolled_losses(
    assistant: Gemma4AssistantForCausalLM,
    target_embed: nn.Module,
    batch: FeatureBatch,
    num_steps: int,
    cluster_of: torch.Tensor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per draft step: token cross-entropy and, with ``cluster_of``, the centroid head's
    cross-entropy on the right token's cluster (on detached hidden states)."""
    token_losses: list[torch.Tensor] = []
    centroid_losses: list[torch.Tensor] = []
    hidden = batch.hidden
    for step in range(1, num_steps + 1):
        tokens = _shifted(batch.ids, step, 0)
        labels = _shifted(batch.greedy, step, 0)
        valid = batch.anchors & _shifted(batch.mask, step, False)
        with torch.no_grad():
            embeds = target_embed(tokens)
        draft_hidden, hidden = draft_step(assistant, embeds, hidden, batch.shared_kv)
        rows = draft_hidden[valid]
        token_losses.append(nn.functional.cross_entropy(assistant.lm_head(rows), labels[valid]))
        if cluster_of is not None:
            assert assistant.masked_embedding is not None
            scores = assistant.masked_embedding.centroids(rows.detach())
            centroid_losses.append(nn.functional.cross_entropy(scores, cluster_of[labels[valid]]))
    return token_losses, centroid_losses


def train_assistant(
    assistant: Gemma4AssistantForCausalLM,
    target_embed: nn.Module,
    batches: Sequence[FeatureBatch],
    *,
    steps: int,
    lr: float,
    num_steps: int,
    seed: int,
    cluster_of: torch.Tensor | None = None,
    log_every: int = 25,
) -> None:
    """AdamW over the feature batches in random order, all draft steps' losses summed."""
    assistant.train()
    params = [p for p in assistant.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    order: list[int] = []
    recent: list[list[float]] = []
    start = time.perf_counter()
    for step in range(steps):
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=max(1, steps // 20))
        token_losses, centroid_losses = unrolled_losses(
            assistant, target_embed, batches[order.pop()], num_steps, cluster_of
        )
        loss = torch.stack(token_losses + centroid_losses).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent.append([float(x.detach()) for x in token_losses + centroid_losses])
        if log_every and (step + 1) % log_every == 0:
            means = [sum(col) / len(col) for col in zip(*recent, strict=True)]
            print(
                f"  assistant step {step + 1}/{steps}: losses "
                + " ".join(f"{m:.2f}" for m in means)
                + f" ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            recent = []
    assistant.eval()


def init_centroids(assistant: Gemma4AssistantForCausalLM, ordering: torch.Tensor) -> torch.Tensor:
    """Install ``token_ordering`` and start each centroid at its cluster's mean lm_head row.

    Returns the cluster of every token."""
    head = assistant.masked_embedding
    assert head is not None
    vocab = ordering.numel()
    size = vocab // head.num_centroids
    cluster_of = torch.empty(vocab, dtype=torch.long)
    cluster_of[ordering] = torch.arange(vocab) // size
    with torch.no_grad():
        head.token_ordering.copy_(ordering)
        rows = assistant.lm_head.weight[ordering].view(head.num_centroids, size, -1)
        head.centroids.weight.copy_(rows.mean(1) * math.sqrt(size))
    return cluster_of


@torch.no_grad()
def draft_accuracy(
    assistant: Gemma4AssistantForCausalLM,
    target_embed: nn.Module,
    batches: Sequence[FeatureBatch],
    num_steps: int,
) -> list[float]:
    """Per draft step, how often the centroid-masked greedy draft is the target's token (given
    that the earlier drafts were right): an offline estimate of per-position acceptance."""
    head = assistant.masked_embedding
    assert head is not None
    size = head.vocab_size_per_centroid
    hits = [0] * num_steps
    total = [0] * num_steps
    for batch in batches:
        hidden = batch.hidden
        for step in range(1, num_steps + 1):
            embeds = target_embed(_shifted(batch.ids, step, 0))
            draft_hidden, hidden = draft_step(assistant, embeds, hidden, batch.shared_kv)
            valid = batch.anchors & _shifted(batch.mask, step, False)
            rows = draft_hidden[valid]
            top = head.centroids(rows).topk(head.centroid_intermediate_top_k, dim=-1).indices
            candidates = head.token_ordering.view(-1, size)[top].flatten(1)  # [N, k * size]
            scores = torch.einsum("nd,ncd->nc", rows, assistant.lm_head.weight[candidates])
            drafts = candidates.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
            labels = _shifted(batch.greedy, step, 0)[valid]
            hits[step - 1] += int((drafts == labels).sum())
            total[step - 1] += int(valid.sum())
    return [h / max(1, t) for h, t in zip(hits, total, strict=True)]
