"""Tell a greedy divergence caused by a near tie from one caused by a fault.

Float32 on a GPU is not exact float32 everywhere: Triton's ``tl.dot`` (vLLM's Triton attention)
multiplies float32 in TF32 by default, and a verification step (k + 1 query tokens per request)
runs other kernels and tile shapes than a one-token decode step. Where the target's two best
tokens are closer than that rounding, speculative and plain decoding may pick different ones,
and both are right to float32 precision. Such a divergence is explained when a float64
reference (transformers, CPU) of the target, fed the tokens both runs agree on, scores both picks
within ``tolerance`` of its best logit; any other divergence is a fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gemma4_spec.testing.tiny import reference_model

__all__ = [
    "DEFAULT_TOLERANCE",
    "Divergence",
    "compared_tokens",
    "divergences",
    "first_divergence",
    "judge",
    "reference_last_logits",
]

# Logit gap (relative to max(1, |best logit|)) below which two tokens count as tied. TF32 keeps
# 10 mantissa bits (rounding ~5e-4 a product), compounded through the target's layers; on the
# tiny random targets, whose best logits lie close together, GPU float32 logits were seen up to
# about half this far from the float64 ones (benchmarks/results/h200/README.md).
DEFAULT_TOLERANCE = 1e-2


@dataclass(frozen=True)
class Divergence:
    prompt: int  # index of the prompt
    position: int  # index into the output where the two runs first differ
    ours: int
    plain: int
    gap_ours: float  # the reference's best logit minus ours' pick's
    gap_plain: float  # the same for plain's pick
    explained: bool  # both picks within the tolerance of the best logit

    def __str__(self) -> str:
        verdict = "a near tie" if self.explained else "NOT a near tie"
        return (
            f"prompt {self.prompt}, output token {self.position}: ours {self.ours}, plain "
            f"{self.plain}; float64 reference gaps to its best logit {self.gap_ours:.2e} and "
            f"{self.gap_plain:.2e}: {verdict}"
        )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix of the
    other and they differ in length), or None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_last_logits(target: str | Path, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits [len(sequences), V] the target (a transformers checkpoint) gives after each
    sequence's last token, computed in float64 on the CPU, one sequence at a time."""
    model = reference_model(target, torch.float64)
    rows = []
    with torch.no_grad():
        for ids in sequences:
            rows.append(model(torch.tensor([list(ids)])).logits[0, -1])
    return torch.stack(rows)


def divergences(
    target: str | Path,
    prompts: Sequence[Sequence[int]],
    ours: Sequence[Sequence[int]],
    plain: Sequence[Sequence[int]],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[Divergence]:
    """Every prompt's first divergence between ``ours`` and ``plain`` outputs, judged against
    the float64 reference of ``target`` (loaded only if some output differs)."""
    found = [
        (i, p)
        for i, (a, b) in enumerate(zip(ours, plain, strict=True))
        if (p := first_divergence(a, b)) is not None
    ]
    if not found:
        return []
    if any(p >= min(len(ours[i]), len(plain[i])) for i, p in found):
        raise ValueError("outputs of different lengths: a fault, not a tie")
    logits = reference_last_logits(target, [[*prompts[i], *plain[i][:p]] for i, p in found])
    return [
        judge(i, p, ours[i][p], plain[i][p], row, tolerance)
        for (i, p), row in zip(found, logits, strict=True)
    ]


def judge(
    prompt: int, position: int, ours: int, plain: int, logits: torch.Tensor, tolerance: float
) -> Divergence:
    """Whether the picks ``ours`` and ``plain`` are tied in the reference ``logits`` [V]."""
    best = float(logits.max())
    gap_ours, gap_plain = best - float(logits[ours]), best - float(logits[plain])
    limit = tolerance * max(1.0, abs(best))
    return Divergence(
        prompt, position, ours, plain, gap_ours, gap_plain, max(gap_ours, gap_plain) <= limit
    )


def compared_tokens(ours: Sequence[Sequence[int]], plain: Sequence[Sequence[int]]) -> float:
    """The share of plain's output tokens that ours matched before its first divergence: a
    check that equal prefixes still cover most of the output."""
    total = sum(len(b) for b in plain)
    matched = sum(
        len(b) if (p := first_divergence(a, b)) is None else p
        for a, b in zip(ours, plain, strict=True)
    )
    return matched / max(total, 1)
