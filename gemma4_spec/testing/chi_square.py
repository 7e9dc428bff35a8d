"""Chi-square tests of token histograms, for the sampling tests: do samples drawn with
speculation follow the distribution drawn without it?

Bins whose expected count is small make the chi-square statistic unreliable, so they are merged
into one bin (and dropped if even the merged bin stays small). The p-value is the chi-square
survival function, ``Q(dof / 2, stat / 2)`` (torch's regularized upper incomplete gamma), so no
statistics library is needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# Expected count below which a bin is merged with the other small ones (the usual rule of 5).
MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    samples: tuple[int, ...]  # sample sizes compared (one: a fit to given probabilities)

    def __str__(self) -> str:
        n = "/".join(str(s) for s in self.samples)
        return f"chi2={self.statistic:.1f} dof={self.dof} p={self.p_value:.3g} (n={n})"


def chi2_survival(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square distributed with ``dof`` degrees of freedom."""
    if dof <= 0:
        return 1.0
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    x = torch.tensor(max(statistic, 0.0) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def _merge_small(expected: torch.Tensor, observed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Columns of ``expected`` / ``observed`` (rows: samples) whose smallest expected count is
    below ``MIN_EXPECTED`` are summed into one column, kept only if that one is large enough."""
    small = expected.min(dim=0).values < MIN_EXPECTED
    big_e, big_o = expected[:, ~small], observed[:, ~small]
    rest_e, rest_o = expected[:, small].sum(dim=1, keepdim=True), observed[:, small].sum(1, True)
    if bool(small.any()) and float(rest_e.min()) >= MIN_EXPECTED:
        big_e, big_o = torch.cat([big_e, rest_e], 1), torch.cat([big_o, rest_o], 1)
    return big_e, big_o


def two_sample(a: Iterable[int], b: Iterable[int]) -> ChiSquare:
    """Whether two samples of tokens come from the same distribution (homogeneity test)."""
    ca, cb = Counter(a), Counter(b)
    tokens = sorted(set(ca) | set(cb))
    observed = torch.tensor([[ca[t] for t in tokens], [cb[t] for t in tokens]], dtype=torch.float64)
    sizes = observed.sum(dim=1, keepdim=True)
    if float(sizes.min()) == 0:
        raise ValueError("two_sample: both samples must be non-empty")
    expected = sizes * observed.sum(dim=0, keepdim=True) / sizes.sum()
    expected, observed = _merge_small(expected, observed)
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.shape[1] - 1
    return ChiSquare(stat, dof, chi2_survival(stat, dof), tuple(int(s) for s in sizes[:, 0]))


def goodness_of_fit(tokens: Iterable[int], probs: Sequence[float] | torch.Tensor) -> ChiSquare:
    """Whether a sample of tokens follows ``probs`` (over token ids 0..len-1). A token of
    probability zero in the sample makes the statistic infinite (p = 0)."""
    p = torch.as_tensor(probs, dtype=torch.float64)
    counts = torch.bincount(torch.as_tensor(list(tokens), dtype=torch.int64), minlength=len(p))
    n = int(counts.sum())
    if n == 0:
        raise ValueError("goodness_of_fit: empty sample")
    if counts.shape[0] > p.shape[0] or bool((counts[p == 0] > 0).any()):
        return ChiSquare(float("inf"), int((p > 0).sum()) - 1, 0.0, (n,))
    support = p > 0
    expected, observed = _merge_small(n * p[support][None], counts[support][None].double())
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.shape[1] - 1
    return ChiSquare(stat, dof, chi2_survival(stat, dof), (n,))
