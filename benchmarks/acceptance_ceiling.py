"""Offline acceptance of greedy vs probabilistic drafts, position by position (transformers, CPU).

Why does probabilistic drafting gain so little over greedy drafting on the shipped tiny pair
(issue 16)? Here, without any vLLM engine: sample continuations of GSM8k test questions (in the
target's chat template) from the target, run the target once over prompt + continuation, and at
every position p of the continuation run the assistant's draft steps exactly as our vLLM
proposer feeds them (``gemma4_spec.training.assistant.draft_step``: step 1 gets the target's new
token and its hidden state at p, step s > 1 the continuation's token and the assistant's own
projected hidden state, every step queries at p over the target's K/V of 0..p). Then per draft
step s and position, with

* p = the target's next-token distribution (temperature, and top-k / top-p where set, as vLLM's
  sampler applies them),
* q_masked = the assistant's softmax at the temperature over its top-k centroids' tokens (zero
  elsewhere): what our probabilistic drafts sample from (vLLM applies only the temperature to
  draft logits),
* q_dense = the same over the whole vocabulary (drafting without the centroid restriction),

the probability that the draft is accepted:

* greedy draft x = argmax q:  p(x)  (vLLM verifies a draft without probabilities as one-hot);
* probabilistic draft x ~ q:  sum_x min(p(x), q(x))  (speculative sampling's acceptance);

and two ceilings: max_x p(x) (the best any greedy drafter can do) and p's mass on the masked
support (the best any drafter restricted to those tokens can do: q = p renormalised there).

Step s > 1 is teacher-forced on the sampled continuation (the token before the draft is the
target's sample, not the accepted draft) and the mean accepted length of k steps is estimated as
1 + sum_s prod_{j<=s} a_j, per position (``chain``) or from the step means (``independent``):
approximations, see the results README. Standard errors come from a bootstrap over questions
(positions of one answer are correlated).

    python benchmarks/acceptance_ceiling.py [--questions 32] [--max-tokens 64] [--k 3] \
        [--simulate PASSES] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    GenerationConfig,
)

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.ops.centroid_argmax import CentroidMask, masked_logits
from gemma4_spec.report import gsm8k_questions
from gemma4_spec.testing.tiny import load_hf_pair
from gemma4_spec.training.assistant import draft_step
from gemma4_spec.training.corpus import prompt_ids
from gemma4_spec.training.features import target_pass

# The per-position quantities, per draft step (names of the JSON output's keys).
GREEDY_MASKED = "greedy_masked"  # p(argmax q_masked): our greedy drafts
PROB_MASKED = "prob_masked"  # sum min(p, q_masked): our probabilistic drafts
GREEDY_DENSE = "greedy_dense"  # p(argmax q_dense)
PROB_DENSE = "prob_dense"  # sum min(p, q_dense)
TARGET_TOP1 = "target_top1"  # max p: ceiling of any greedy drafter
SUPPORT_MASS = "support_mass"  # p's mass on q_masked's support: ceiling of any masked drafter
AGREE = "agree"  # argmax q_masked == the target's argmax (greedy drafts' T=0 acceptance)
QUANTITIES = (
    GREEDY_MASKED,
    PROB_MASKED,
    GREEDY_DENSE,
    PROB_DENSE,
    TARGET_TOP1,
    SUPPORT_MASS,
    AGREE,
)
# Draft methods whose accepted length we estimate (a per-step acceptance probability each).
METHODS = (GREEDY_MASKED, PROB_MASKED, GREEDY_DENSE, PROB_DENSE)


@dataclass(frozen=True)
class Setting:
    """One request sampling configuration (vLLM's SamplingParams fields)."""

    name: str
    temperature: float
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


SETTINGS = (
    Setting("T=0", 0.0),  # validates the estimator against the measured greedy run
    Setting("T=0.5", 0.5),
    Setting("T=1.0", 1.0),
    Setting("T=0.6 top_p=0.95 top_k=64", 0.6, top_k=64, top_p=0.95),
)

# The settings whose decoding loop --simulate runs (the ones measured through vLLM).
SIMULATED = ("T=0.5", "T=1.0")


# --- the formulas (unit-tested in tests/test_acceptance_ceiling.py) --------------------------


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The distribution of a greedy choice: 1 on the (first) maximal entry."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The target's sampling distribution as vLLM's sampler builds it: logits / temperature,
    then top-k (ties with the k-th value kept), then top-p (drop the smallest tokens while their
    cumulative probability stays <= 1 - top_p; the largest is always kept), then softmax.
    Temperature 0 is greedy: one-hot on the argmax."""
    if temperature == 0.0:
        return one_hot_argmax(logits)
    scaled = logits.float() / temperature
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = scaled.sort(dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1.0 - top_p
        drop[..., -1] = False
        scaled = scaled.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return scaled.softmax(-1)


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """What probabilistic drafts sample from: softmax(logits / temperature) (vLLM applies no
    top-k / top-p to draft logits); ``-inf`` logits get probability 0. Temperature 0: one-hot."""
    if temperature == 0.0:
        return one_hot_argmax(logits)
    return (logits.float() / temperature).softmax(-1)


def greedy_acceptance(p: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """P(accept) of a deterministic draft x: p(x) (verification with a one-hot q)."""
    return p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)


def probabilistic_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(accept) of a draft x ~ q verified by speculative sampling (accept with
    min(1, p(x)/q(x))): sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    return torch.minimum(p, q).sum(-1)


def expected_accepted(acceptance: torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts of k steps, ``acceptance`` [..., k] the per-step probabilities
    (step s counted only if steps 1..s-1 were accepted): sum_s prod_{j<=s} a_j. The mean
    accepted length (vLLM's, with the bonus/recovered token) is 1 + this."""
    return acceptance.cumprod(-1).sum(-1)


# --- the models ------------------------------------------------------------------------------


@torch.no_grad()
def sample_continuations(
    target: Gemma4ForCausalLM,
    prompts: Sequence[Sequence[int]],
    setting: Setting,
    max_tokens: int,
    seed: int,
) -> list[list[int]]:
    """The target's continuation of each prompt under ``setting`` (one left-padded batch), cut
    after the first end-of-sequence token as vLLM stops there."""
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad_id = target.config.pad_token_id
    sampled = setting.temperature > 0
    config = GenerationConfig(
        do_sample=sampled,
        temperature=setting.temperature if sampled else None,
        top_k=setting.top_k if sampled else None,  # 0 (off) overrides transformers' 50
        top_p=setting.top_p if sampled else None,
        max_new_tokens=max_tokens,
        pad_token_id=pad_id,
        bos_token_id=target.config.bos_token_id,
        eos_token_id=sorted(eos_ids),
    )
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(list(prompt))
        mask[row, length - len(prompt) :] = 1
    torch.manual_seed(seed)
    generated = target.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    out = []
    for row in generated[:, length:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:cut])
    return out


@dataclass
class StepOutputs:
    """Per draft step s (index s-1), over the evaluated positions ``[N]``."""

    target_logits: list[torch.Tensor]  # [N, V]: the target's logits the draft is verified by
    masked_logits: list[torch.Tensor]  # [N, V]: assistant, -inf outside the top-k centroids
    dense_logits: list[torch.Tensor]  # [N, V]: assistant, full vocabulary
    question: torch.Tensor  # [N]: which question each position belongs to


def centroid_mask(assistant: Gemma4AssistantForCausalLM) -> CentroidMask:
    """The assistant's centroid restriction as the plugin's compute_logits applies it."""
    head = assistant.masked_embedding
    assert head is not None, "the assistant has no centroid head"
    suppress = getattr(assistant.generation_config, "suppress_tokens", None) or []
    return CentroidMask(
        head.centroids.weight,
        head.token_ordering,
        head.centroid_intermediate_top_k,
        torch.tensor(list(suppress), dtype=torch.long) if suppress else None,
    )


def _shifted(values: torch.Tensor, shift: int, fill: int | bool) -> torch.Tensor:
    """``values[:, p + shift]`` at column p along dimension 1 (``fill`` past the end)."""
    out = torch.full_like(values, fill)
    out[:, : values.shape[1] - shift] = values[:, shift:]
    return out


@torch.no_grad()
def draft_outputs(
    target: Gemma4ForCausalLM,
    assistant: Gemma4AssistantForCausalLM,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    k: int,
) -> StepOutputs:
    """One target pass over every prompt + continuation, then k draft steps at every position p
    from the last prompt token on whose k drafted tokens all lie inside the continuation.

    Step s at p: input token x_{p+s}, verified by the target's logits at p+s (the distribution
    of x_{p+s+1})."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations, strict=True)]
    ids, mask, out, shared = target_pass(target, seqs)
    anchors = torch.zeros_like(mask)
    for row, prompt in enumerate(prompts):
        anchors[row, len(prompt) - 1 :] = True
    valid = anchors & _shifted(mask, k + 1, False)
    question = torch.arange(len(seqs)).unsqueeze(1).expand_as(ids)[valid]
    mask_rule = centroid_mask(assistant)
    embed = target.get_input_embeddings()
    hidden = out.hidden_states[-1]
    outputs = StepOutputs([], [], [], question)
    for step in range(1, k + 1):
        draft_hidden, hidden = draft_step(assistant, embed(_shifted(ids, step, 0)), hidden, shared)
        rows = draft_hidden[valid]
        outputs.target_logits.append(_shifted(out.logits, step, 0)[valid])
        outputs.masked_logits.append(masked_logits(rows, assistant.lm_head.weight, mask_rule))
        outputs.dense_logits.append(assistant.lm_head(rows))
    return outputs


def per_position(steps: StepOutputs, setting: Setting) -> dict[str, torch.Tensor]:
    """Every quantity of ``QUANTITIES`` per position and step: ``[N, k]`` each."""
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in QUANTITIES}
    for target_logits, masked, dense in zip(
        steps.target_logits, steps.masked_logits, steps.dense_logits, strict=True
    ):
        p = target_probs(target_logits, setting.temperature, setting.top_k, setting.top_p)
        q_masked = draft_probs(masked, setting.temperature)
        q_dense = draft_probs(dense, setting.temperature)
        masked_draft = masked.argmax(-1)
        columns[GREEDY_MASKED].append(greedy_acceptance(p, masked_draft))
        columns[PROB_MASKED].append(probabilistic_acceptance(p, q_masked))
        columns[GREEDY_DENSE].append(greedy_acceptance(p, dense.argmax(-1)))
        columns[PROB_DENSE].append(probabilistic_acceptance(p, q_dense))
        columns[TARGET_TOP1].append(p.max(-1).values)
        columns[SUPPORT_MASS].append(p.masked_fill(masked == float("-inf"), 0.0).sum(-1))
        columns[AGREE].append((masked_draft == target_logits.argmax(-1)).float())
    return {name: torch.stack(values, dim=1) for name, values in columns.items()}


# --- a Monte Carlo replica of the decoding loop (cross-check) ------------------------------


@dataclass(frozen=True)
class Cycle:
    """One draft-verify cycle of the simulated loop."""

    question: int
    accepted: int  # drafts accepted (0..k)
    step1_expected: float  # P(accept) of its first draft given the context: sum min(p1, q1)
    after_rejection: bool  # its context ends in a replacement token (the last cycle rejected)


@dataclass
class LoopCounts:
    """Counters as vLLM's spec-decode metrics keep them, and every cycle."""

    num_drafts: int = 0  # draft-verify cycles
    accepted_per_position: list[int] | None = None  # accepted drafts at step s (all earlier ok)
    cycles: list[Cycle] = field(default_factory=list)

    def add(self, cycle: Cycle, k: int) -> None:
        if self.accepted_per_position is None:
            self.accepted_per_position = [0] * k
        self.num_drafts += 1
        for s in range(cycle.accepted):
            self.accepted_per_position[s] += 1
        self.cycles.append(cycle)


@torch.no_grad()
def _draft_at(
    assistant: Gemma4AssistantForCausalLM,
    token_embed: torch.Tensor,
    hidden: torch.Tensor,
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
    anchor: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step with its query at ``anchor`` over the target's K/V of 0..anchor.

    ``draft_step`` queries at every position of its input; a KV-shared assistant's query reads
    nothing of the other queries, so we hand it ``anchor + 1`` copies of the one input and keep
    the last row (which sits at position ``anchor``). Returns (lm_head input, next hidden), [d]."""
    rows = anchor + 1
    kv = {name: (key[:, :, :rows], value[:, :, :rows]) for name, (key, value) in shared_kv.items()}
    embeds = token_embed.reshape(1, 1, -1).expand(1, rows, -1)
    hiddens = hidden.reshape(1, 1, -1).expand(1, rows, -1)
    draft_hidden, next_hidden = draft_step(assistant, embeds, hiddens, kv)
    return draft_hidden[0, -1], next_hidden[0, -1]


@torch.no_grad()
def simulate_decoding(
    target: Gemma4ForCausalLM,
    assistant: Gemma4AssistantForCausalLM,
    prompt: Sequence[int],
    setting: Setting,
    method: str,
    k: int,
    max_tokens: int,
    gen: torch.Generator,
    counts: LoopCounts,
    question: int = 0,
) -> list[int]:
    """Speculative decoding of one request, as vLLM runs it, with real random draws.

    Each cycle: k drafts from the last accepted position p (greedy: argmax of the masked
    logits, q one-hot; probabilistic: x ~ q_masked), one target pass over everything, then
    accept draft j with probability min(1, p_j(x_j) / q_j(x_j)); the first rejection is replaced
    by a draw from max(p_j - q_j, 0) (renormalised), and if all k pass a bonus token is drawn
    from p_{k+1}. The target pass of one cycle is the next cycle's context (causal: the rejected
    drafts do not change the positions before them). Stops after ``max_tokens`` or an
    end-of-sequence token. Returns the generated tokens."""
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    mask_rule = centroid_mask(assistant)
    embed = target.get_input_embeddings()

    def forward(ids: list[int]) -> Any:
        tensor = torch.tensor([ids], dtype=torch.long)
        return target(
            input_ids=tensor,
            attention_mask=torch.ones_like(tensor),
            use_cache=False,
            output_hidden_states=True,
            return_shared_kv_states=True,
        )

    def sample(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=gen))

    def probs_of(logits: torch.Tensor) -> torch.Tensor:
        return target_probs(logits, setting.temperature, setting.top_k, setting.top_p)

    ids = list(prompt)
    out = forward(ids)
    generated = [sample(probs_of(out.logits[0, -1]))]
    rejected = False  # whether the last cycle ended in a rejection
    while len(generated) < max_tokens and generated[-1] not in eos_ids:
        context = ids + generated
        anchor = len(context) - 2
        shared = {name: (key, value) for name, (key, value) in out.shared_kv_states.items()}
        token = torch.tensor(context[-1])
        hidden = out.hidden_states[-1][0, anchor]
        drafts: list[int] = []
        draft_dists: list[torch.Tensor] = []
        for _ in range(k):
            draft_hidden, hidden = _draft_at(assistant, embed(token), hidden, shared, anchor)
            logits = masked_logits(draft_hidden[None], assistant.lm_head.weight, mask_rule)[0]
            if method == "greedy":
                q = one_hot_argmax(logits)
                draft = int(logits.argmax())
            else:
                q = draft_probs(logits, setting.temperature)
                draft = sample(q)
            drafts.append(draft)
            draft_dists.append(q)
            token = torch.tensor(draft)
        out = forward(context + drafts)
        verify = out.logits[0, len(context) - 1 :]  # [k + 1, V]: p_1 .. p_{k+1}
        step1_expected = float(probabilistic_acceptance(probs_of(verify[0]), draft_dists[0]))
        new_tokens: list[int] = []
        for j, (draft, q) in enumerate(zip(drafts, draft_dists, strict=True)):
            p = probs_of(verify[j])
            ratio = float(p[draft] / q[draft]) if float(q[draft]) > 0 else 0.0
            if float(torch.rand((), generator=gen)) < min(1.0, ratio):
                new_tokens.append(draft)
                continue
            residual = (p - q).clamp(min=0.0)
            new_tokens.append(sample(residual / residual.sum()))
            break
        else:
            new_tokens.append(sample(probs_of(verify[k])))
        counts.add(Cycle(question, len(new_tokens) - 1, step1_expected, rejected), k)
        rejected = len(new_tokens) - 1 < k
        for new in new_tokens:
            generated.append(new)
            if new in eos_ids or len(generated) >= max_tokens:
                break
        # The next cycle's context must be a prefix of this pass: it is (accepted drafts are
        # the drafts themselves; the replacement or bonus token is the last, unprocessed one).
    return generated


def simulate(
    target: Gemma4ForCausalLM,
    assistant: Gemma4AssistantForCausalLM,
    prompts: Sequence[Sequence[int]],
    setting: Setting,
    k: int,
    max_tokens: int,
    passes: int,
    seed: int,
    resamples: int,
) -> dict[str, Any]:
    """Both draft methods over every prompt, ``passes`` times: vLLM's acceptance counters."""
    result: dict[str, Any] = {}
    for method in ("greedy", "probabilistic"):
        gen = torch.Generator().manual_seed(seed)
        counts = LoopCounts()
        for _ in range(passes):
            for question, prompt in enumerate(prompts):
                simulate_decoding(
                    target, assistant, prompt, setting, method, k, max_tokens, gen, counts, question
                )
        accepted = counts.accepted_per_position or [0] * k
        cycles = counts.cycles
        after = torch.tensor([float(c.after_rejection) for c in cycles])
        step1 = torch.tensor([float(c.accepted > 0) for c in cycles])
        expected = torch.tensor([c.step1_expected for c in cycles])
        columns = {
            "accepted": torch.tensor([float(c.accepted) for c in cycles]),
            "step1": step1,
            "expected": expected,
            "after": after,
            "step1_after": step1 * after,
            "expected_after": expected * after,
        }
        question = torch.tensor([c.question for c in cycles])
        stats = Clustered(columns, question, resamples, seed)
        result[method] = {
            "num_drafts": counts.num_drafts,
            "accepted_per_position": accepted,
            "acceptance_rate": stats.estimate(lambda m: m["accepted"] / k),
            "mean_accepted_length": stats.estimate(lambda m: 1.0 + m["accepted"]),
            "step1": stats.estimate(lambda m: m["step1"]),
            # The first draft's acceptance probability averaged over the contexts the loop
            # drafts from (all cycles; those after a rejection; the rest): the same formula as
            # the per-position table, but weighted as the loop visits positions.
            "step1_expected": stats.estimate(lambda m: m["expected"]),
            "share_after_rejection": stats.estimate(lambda m: m["after"]),
            "step1_expected_after_rejection": stats.estimate(
                lambda m: m["expected_after"] / m["after"]
            ),
            "step1_expected_otherwise": stats.estimate(
                lambda m: (m["expected"] - m["expected_after"]) / (1 - m["after"])
            ),
        }
    greedy = result["greedy"]["mean_accepted_length"]
    prob = result["probabilistic"]["mean_accepted_length"]
    ratio = prob["mean"] / greedy["mean"]
    # The two methods' runs are independent: relative errors add in quadrature.
    relative = ((prob["se"] / prob["mean"]) ** 2 + (greedy["se"] / greedy["mean"]) ** 2) ** 0.5
    result["length_ratio"] = {"mean": ratio, "se": ratio * relative}
    return result


# --- statistics ------------------------------------------------------------------------------


class Clustered:
    """Means over positions with standard errors from a bootstrap over questions.

    Holds per-question sums of each per-position column; a resample draws questions with
    replacement and every derived figure is recomputed from its column means."""

    def __init__(
        self, columns: dict[str, torch.Tensor], question: torch.Tensor, resamples: int, seed: int
    ) -> None:
        groups = int(question.max()) + 1
        self.names = list(columns)
        values = torch.stack([columns[n].double() for n in self.names], dim=1)  # [N, M]
        sums = torch.zeros(groups, values.shape[1], dtype=torch.float64)
        sums.index_add_(0, question, values)
        counts = torch.bincount(question, minlength=groups).double()
        gen = torch.Generator().manual_seed(seed)
        picks = torch.randint(groups, (resamples, groups), generator=gen)
        weights = torch.zeros(resamples, groups, dtype=torch.float64)
        weights.scatter_add_(1, picks, torch.ones_like(picks, dtype=torch.float64))
        weights = torch.cat([torch.ones(1, groups, dtype=torch.float64), weights])  # row 0: data
        self.means = (weights @ sums) / (weights @ counts).unsqueeze(1)  # [1 + R, M]

    def estimate(self, figure: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> dict:
        """``figure`` of the column means (each a [1 + R] tensor): its value and bootstrap SE."""
        values = figure({n: self.means[:, i] for i, n in enumerate(self.names)})
        return {"mean": float(values[0]), "se": float(values[1:].std())}


def summarise(
    columns: dict[str, torch.Tensor],
    question: torch.Tensor,
    k: int,
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    """Means and SEs of every quantity per step, the probabilistic / greedy ratios and the
    estimated mean accepted lengths."""
    flat: dict[str, torch.Tensor] = {}
    for name, values in columns.items():
        for s in range(k):
            flat[f"{name}@{s + 1}"] = values[:, s]
    for method in METHODS:
        flat[f"chain_{method}"] = expected_accepted(columns[method])
    stats = Clustered(flat, question, resamples, seed)
    result: dict[str, Any] = {"positions": int(question.numel())}
    result["per_step"] = {
        name: [stats.estimate(lambda m, key=f"{name}@{s + 1}": m[key]) for s in range(k)]
        for name in columns
    }

    def independent(method: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        def figure(m: dict[str, torch.Tensor]) -> torch.Tensor:
            steps = torch.stack([m[f"{method}@{s + 1}"] for s in range(k)], dim=-1)
            return 1.0 + expected_accepted(steps)

        return figure

    lengths: dict[str, Any] = {}
    for method in METHODS:
        lengths[method] = {
            "chain": stats.estimate(lambda m, key=f"chain_{method}": 1.0 + m[key]),
            "independent": stats.estimate(independent(method)),
            "accepted_per_drafted": stats.estimate(lambda m, key=f"chain_{method}": m[key] / k),
        }
    result["length"] = lengths
    ratios: dict[str, Any] = {}
    for prob, greedy in ((PROB_MASKED, GREEDY_MASKED), (PROB_DENSE, GREEDY_DENSE)):
        ratios[f"{prob}/{greedy}"] = {
            "step1": stats.estimate(lambda m, a=prob, b=greedy: m[f"{a}@1"] / m[f"{b}@1"]),
            "length_chain": stats.estimate(
                lambda m, a=prob, b=greedy: (1 + m[f"chain_{a}"]) / (1 + m[f"chain_{b}"])
            ),
            "length_independent": stats.estimate(
                lambda m, a=prob, b=greedy: independent(a)(m) / independent(b)(m)
            ),
        }
    result["ratio"] = ratios
    return result


# --- output ----------------------------------------------------------------------------------


def _fmt(stat: dict[str, float], digits: int = 3) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['se']:.{digits}f}"


def markdown_tables(results: dict[str, Any]) -> str:
    """The README's tables: step-1 acceptance and ceilings, then lengths and ratios."""
    lines = [
        "| setting | positions | greedy p(argmax q) | probabilistic Σmin(p,q) | ratio "
        "| dense greedy | dense probabilistic | dense ratio | max p | p on mask | argmax agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["settings"].items():
        step = {key: values[0] for key, values in r["per_step"].items()}
        lines.append(
            f"| {name} | {r['positions']} | {_fmt(step[GREEDY_MASKED])} "
            f"| {_fmt(step[PROB_MASKED])} "
            f"| {_fmt(r['ratio'][f'{PROB_MASKED}/{GREEDY_MASKED}']['step1'])} "
            f"| {_fmt(step[GREEDY_DENSE])} | {_fmt(step[PROB_DENSE])} "
            f"| {_fmt(r['ratio'][f'{PROB_DENSE}/{GREEDY_DENSE}']['step1'])} "
            f"| {_fmt(step[TARGET_TOP1])} | {_fmt(step[SUPPORT_MASS])} | {_fmt(step[AGREE])} |"
        )
    k = results["config"]["k"]
    lines += [
        "",
        f"| setting | drafts | acceptance at steps 1..{k} | est. accepted/drafted "
        "| est. mean accepted length (chain) | (independent) | probabilistic/greedy length |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["settings"].items():
        for method in (GREEDY_MASKED, PROB_MASKED):
            steps = " / ".join(f"{s['mean']:.3f}" for s in r["per_step"][method])
            ratio = r["ratio"][f"{PROB_MASKED}/{GREEDY_MASKED}"]["length_chain"]
            lines.append(
                f"| {name} | {method.split('_')[0]} | {steps} "
                f"| {_fmt(r['length'][method]['accepted_per_drafted'])} "
                f"| {_fmt(r['length'][method]['chain'], 2)} "
                f"| {r['length'][method]['independent']['mean']:.2f} "
                f"| {_fmt(ratio) if method == PROB_MASKED else ''} |"
            )
    simulated = {n: r["simulated"] for n, r in results["settings"].items() if "simulated" in r}
    if simulated:
        lines += [
            "",
            "| setting | drafts | cycles | accepted at steps 1..k | accepted/drafted "
            "| mean accepted length | probabilistic/greedy length | step-1 accepted "
            "| step-1 P(accept): all cycles | after a rejection | otherwise "
            "| cycles after a rejection |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, sim in simulated.items():
            for method in ("greedy", "probabilistic"):
                m = sim[method]
                ratio = _fmt(sim["length_ratio"]) if method == "probabilistic" else ""
                lines.append(
                    f"| {name} | {method} | {m['num_drafts']} | {m['accepted_per_position']} "
                    f"| {_fmt(m['acceptance_rate'])} | {_fmt(m['mean_accepted_length'])} "
                    f"| {ratio} | {_fmt(m['step1'])} | {_fmt(m['step1_expected'])} "
                    f"| {_fmt(m['step1_expected_after_rejection'])} "
                    f"| {_fmt(m['step1_expected_otherwise'])} "
                    f"| {_fmt(m['share_after_rejection'])} |"
                )
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32, help="GSM8k test questions")
    parser.add_argument("--max-tokens", type=int, default=64, help="sampled tokens per question")
    parser.add_argument("--k", type=int, default=3, help="draft steps")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0)
    # One thread: on a shared 2-core machine two threads made a batch-1 target pass ~25x
    # slower than one (they wait on each other), and the models are too small to gain from two.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="PASSES",
        help="also run the decoding loop itself (Monte Carlo) PASSES times over the questions "
        "at the settings in SIMULATED (0: off)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()

    target_dir, assistant_dir = tiny_gsm8k_pair()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [prompt_ids(tokenizer, q) for q in gsm8k_questions(args.questions)]
    target, assistant = load_hf_pair(target_dir, assistant_dir)

    results: dict[str, Any] = {
        "config": {
            **{key: value for key, value in vars(args).items() if key != "json"},
            "commit": _commit(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": {},
    }
    for index, setting in enumerate(SETTINGS):
        continuations = sample_continuations(
            target, prompts, setting, args.max_tokens, args.seed + index
        )
        steps = draft_outputs(target, assistant, prompts, continuations, args.k)
        columns = per_position(steps, setting)
        summary = summarise(columns, steps.question, args.k, args.resamples, args.seed)
        summary["setting"] = asdict(setting)
        summary["mean_continuation_tokens"] = sum(map(len, continuations)) / len(continuations)
        results["settings"][setting.name] = summary
        print(f"{setting.name}: {summary['positions']} positions", file=sys.stderr, flush=True)
        if args.simulate and setting.name in SIMULATED:
            summary["simulated"] = simulate(
                target,
                assistant,
                prompts,
                setting,
                args.k,
                args.max_tokens,
                args.simulate,
                args.seed + 100 + index,
                args.resamples,
            )
            print(f"{setting.name}: simulated", file=sys.stderr, flush=True)
    results["seconds"] = round(time.perf_counter() - began, 1)

    print(markdown_tables(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
