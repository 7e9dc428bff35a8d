"""vLLM's speculative-decoding counters, and the figures read from them (one place for both).

vLLM counts, per engine: drafting steps (``num_drafts``), drafted tokens, accepted tokens, and
accepted tokens per draft position. Acceptance stops at the first rejected draft token, so the
per-position counts never increase with the position."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SPEC_PREFIX = "vllm:spec_decode_"


def spec_metrics(metrics: list[Any]) -> dict[str, Any]:
    """The ``vllm:spec_decode_*`` counters of ``LLM.get_metrics()`` (per-position ones as a
    list)."""
    found: dict[str, Any] = {}
    for metric in metrics:
        if metric.name.startswith(SPEC_PREFIX):
            found[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return found


@dataclass(frozen=True)
class Acceptance:
    """Speculation figures from vLLM's spec-decode counters over a run."""

    num_drafts: int  # drafting steps (target steps that verified a draft)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]  # [k]: drafts whose token i (0-based) was accepted

    @classmethod
    def between(cls, before: dict[str, Any], after: dict[str, Any]) -> Acceptance:
        """The counters' growth from ``before`` to ``after`` (``spec_metrics`` dicts)."""

        def grown(name: str) -> int:
            return int(after.get(SPEC_PREFIX + name, 0)) - int(before.get(SPEC_PREFIX + name, 0))

        name = SPEC_PREFIX + "num_accepted_tokens_per_pos"
        now, then = after.get(name, []), before.get(name, [])
        then = list(then) + [0] * (len(now) - len(then))
        return cls(
            num_drafts=grown("num_drafts"),
            num_draft_tokens=grown("num_draft_tokens"),
            num_accepted_tokens=grown("num_accepted_tokens"),
            accepted_per_position=[int(a) - int(b) for a, b in zip(now, then, strict=True)],
        )

    @property
    def rate_per_position(self) -> list[float]:
        """P(draft token i accepted) per drafting step; non-increasing, since acceptance stops
        at the first rejected token."""
        d = self.num_drafts
        return [n / d if d else 0.0 for n in self.accepted_per_position]

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        d = self.num_draft_tokens
        return self.num_accepted_tokens / d if d else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target step: the target's own token plus the accepted drafts."""
        d = self.num_drafts
        return 1.0 + self.num_accepted_tokens / d if d else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "rate_per_position": self.rate_per_position,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }

    @classmethod
    def of(cls, counters: dict[str, Any]) -> Acceptance:
        """The counters of a whole run (``spec_metrics`` of an engine that ran only it)."""
        return cls.between({}, counters)
