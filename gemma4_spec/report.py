"""Acceptance and speed-up report: the same greedy prompts with and without Gemma 4 MTP.

``run_report`` starts one vLLM engine without speculation and one with it, in turn, on the same
chat-formatted prompts (by default the first GSM8k test questions), and measures both the same
way: requests go in batches of ``batch_size`` (1 by default: one request at a time, the latency a
user sees), and only the time inside ``LLM.generate`` counts, after one warm-up request, so
engine start-up and first-call costs are left out. Each engine goes over the prompts ``passes``
times and its tokens/s is the median pass's: one pass of a few seconds on a small CPU machine
moves by a fifth between runs. The outputs compared and the acceptance (vLLM's own
``vllm:spec_decode_*`` counters, read before and after) are the first pass's.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemma4_spec.metrics import Acceptance, spec_metrics
from gemma4_spec.testing.engine_run import RunConfig, engine_kwargs

JSON_NAME = "acceptance.json"
PNG_NAME = "acceptance.png"
# Room in the engine's max_model_len beyond the longest prompt plus max_tokens (the drafts).
_LEN_MARGIN = 16
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class ReportConfig:
    target: str
    assistant: str
    k: int = 3  # num_speculative_tokens
    num_prompts: int = 16
    max_tokens: int = 128
    dtype: str = "float32"
    batch_size: int = 1
    gsm8k: str | None = None  # GSM8k folder; None: the copy shipped in the package
    temperature: float = 0.0  # 0: greedy requests, whose outputs must match token for token
    draft_method: str = "greedy"  # vLLM's draft_sample_method: "greedy" or "probabilistic"
    passes: int = 3  # timed passes over the prompts; tokens/s is the median pass's


DRAFT_METHODS = ("greedy", "probabilistic")


@dataclass
class Timing:
    """One engine's timed passes over the prompts: generated tokens and seconds inside
    ``LLM.generate``, a pair a pass (sampled passes may generate different counts)."""

    tokens: list[int]
    seconds: list[float]

    @property
    def rates(self) -> list[float]:
        return [n / s if s > 0 else 0.0 for n, s in zip(self.tokens, self.seconds, strict=True)]

    @property
    def median_pass(self) -> int:
        """The index of the median pass by rate (of an even count, the lower middle one)."""
        rates = self.rates
        order = sorted(range(len(rates)), key=rates.__getitem__)
        return order[(len(order) - 1) // 2]

    @property
    def tokens_per_s(self) -> float:
        """The median pass's rate: a rate one pass had."""
        return self.rates[self.median_pass]


@dataclass
class Run:
    token_ids: list[list[int]]
    texts: list[str]
    timing: Timing
    acceptance: Acceptance | None = None  # None without speculation


@dataclass
class Report:
    config: ReportConfig
    questions: list[str]
    plain: Run
    speculative: Run
    command: list[str] = field(default_factory=list)

    @property
    def acceptance(self) -> Acceptance:
        assert self.speculative.acceptance is not None
        return self.speculative.acceptance

    @property
    def greedy(self) -> bool:
        return self.config.temperature == 0

    @property
    def outputs_identical(self) -> bool:
        """Whether both runs produced the same tokens (asked of greedy runs only: sampled runs
        keep the distribution, not the draws)."""
        return self.plain.token_ids == self.speculative.token_ids

    @property
    def speedup(self) -> float:
        plain = self.plain.timing.tokens_per_s
        return self.speculative.timing.tokens_per_s / plain if plain else 0.0

    def as_dict(self) -> dict[str, Any]:
        import vllm

        import gemma4_spec

        return {
            "config": asdict(self.config),
            "command": self.command,
            "vllm_version": vllm.__version__,
            "gemma4_spec_version": getattr(gemma4_spec, "__version__", None),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "k": self.config.k,
            "num_prompts": len(self.questions),
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
            "draft_method": self.config.draft_method,
            "outputs_identical": self.outputs_identical if self.greedy else None,
            "acceptance": self.acceptance.as_dict(),
            "plain": _timing_dict(self.plain.timing),
            "speculative": _timing_dict(self.speculative.timing),
            "speedup": self.speedup,
        }


def _timing_dict(timing: Timing) -> dict[str, Any]:
    return {
        "passes": [
            {"tokens": n, "seconds": s} for n, s in zip(timing.tokens, timing.seconds, strict=True)
        ],
        "tokens_per_s": timing.tokens_per_s,
    }


def check_config(config: ReportConfig) -> None:
    """Reject bad input before any engine starts: counts below 1, a missing checkpoint folder,
    an assistant that does not fit the target (``gemma4_spec.validation.validate_pair``)."""
    for name in ("k", "num_prompts", "max_tokens", "batch_size", "passes"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(config, name)}")
    if not config.temperature >= 0:
        raise ValueError(f"temperature must be 0 (greedy) or more, not {config.temperature}")
    if config.draft_method not in DRAFT_METHODS:
        raise ValueError(
            f"draft method must be one of {DRAFT_METHODS}, not {config.draft_method!r}"
        )
    for role in ("target", "assistant"):
        where = getattr(config, role)
        if _is_local(where) and not (Path(where).expanduser() / "config.json").is_file():
            raise FileNotFoundError(f"{role} {where} is not a checkpoint folder (no config.json)")
    from transformers import AutoConfig

    from gemma4_spec.validation import validate_pair

    validate_pair(
        AutoConfig.from_pretrained(config.target), AutoConfig.from_pretrained(config.assistant)
    )


def _is_local(where: str) -> bool:
    """A local path rather than a hub id (``org/name``): absolute, relative with ``.``/``~``, or
    starting with a folder that exists here."""
    path = Path(where).expanduser()
    return (
        path.exists()
        or not _HUB_ID.match(where)
        or where.startswith((".", "~"))
        or Path(path.parts[0]).is_dir()
    )


def chat_prompts(target: str, questions: Sequence[str]) -> list[list[int]]:
    """Token ids of each question as one user turn in the target's chat template, ready for
    the model's answer."""
    from transformers import AutoTokenizer

    from gemma4_spec.training.corpus import prompt_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as error:
        raise ValueError(f"the target {target} has no usable tokenizer: {error}") from error
    if not tokenizer.chat_template:
        raise ValueError(f"the target {target}'s tokenizer has no chat template")
    return [prompt_ids(tokenizer, question) for question in questions]


def gsm8k_questions(num_prompts: int, folder: str | None = None) -> list[str]:
    from gemma4_spec.data import gsm8k

    problems = gsm8k.load("test", limit=num_prompts, folder=folder)
    if len(problems) < num_prompts:
        raise ValueError(f"GSM8k test has only {len(problems)} questions, {num_prompts} asked")
    return [p.question for p in problems]


def _spec_counters(llm: Any) -> dict[str, Any]:
    return spec_metrics(llm.get_metrics())


def _run_engine(
    config: ReportConfig,
    prompts: list[list[int]],
    *,
    speculative: bool,
    progress: bool,
) -> Run:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run_config = RunConfig(
        target=config.target,
        prompts=prompts,
        assistant=config.assistant if speculative else None,
        num_speculative_tokens=config.k,
        max_tokens=config.max_tokens,
        dtype=config.dtype,
        max_model_len=max(len(p) for p in prompts) + config.max_tokens + _LEN_MARGIN,
        extra_engine_kwargs={"skip_tokenizer_init": False},
    )
    kwargs = engine_kwargs(run_config)
    if speculative and config.draft_method != "greedy":
        kwargs["speculative_config"]["draft_sample_method"] = config.draft_method
    llm = LLM(**kwargs)
    try:
        # Sampled requests carry no seed: a seeded request drafts greedily (seeded_drafts.py).
        params = SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            seed=0 if config.temperature == 0 else None,
        )
        # Warm-up: first-call costs stay out of the timing, its drafts out of the counters.
        warm = SamplingParams(max_tokens=min(8, config.max_tokens), temperature=0.0)
        llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)
        before = _spec_counters(llm)
        acceptance = None
        token_ids: list[list[int]] = []
        texts: list[str] = []
        timing = Timing(tokens=[], seconds=[])
        label = "speculative" if speculative else "plain"
        with tqdm(
            total=len(prompts) * config.passes,
            desc=f"{label:>11}",
            unit="prompt",
            disable=not progress,
        ) as bar:
            for number in range(config.passes):
                completions, seconds = _timed_pass(llm, prompts, params, config.batch_size, bar)
                timing.tokens.append(sum(len(c.token_ids) for c in completions))
                timing.seconds.append(seconds)
                if number == 0:
                    token_ids = [list(c.token_ids) for c in completions]
                    texts = [c.text for c in completions]
                    if speculative:
                        acceptance = Acceptance.between(before, _spec_counters(llm))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return Run(token_ids=token_ids, texts=texts, timing=timing, acceptance=acceptance)


def _timed_pass(
    llm: Any, prompts: list[list[int]], params: Any, batch_size: int, bar: Any
) -> tuple[list[Any], float]:
    """One pass over ``prompts`` in batches of ``batch_size``: each prompt's completion (vLLM's
    ``CompletionOutput``), in order, and the seconds spent inside ``LLM.generate``."""
    completions: list[Any] = []
    seconds = 0.0
    for start in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": p} for p in prompts[start : start + batch_size]]
        began = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds += time.perf_counter() - began
        completions += [o.outputs[0] for o in outputs]
        bar.update(len(batch))
    return completions, seconds


def run_report(
    config: ReportConfig,
    *,
    questions: Sequence[str] | None = None,
    progress: bool = True,
    command: Sequence[str] | None = None,
) -> Report:
    """Run the prompts without, then with speculation. ``questions`` defaults to the first
    ``config.num_prompts`` GSM8k test questions."""
    check_config(config)
    asked = (
        list(questions)
        if questions is not None
        else gsm8k_questions(config.num_prompts, config.gsm8k)
    )
    prompts = chat_prompts(config.target, asked)
    plain = _run_engine(config, prompts, speculative=False, progress=progress)
    spec = _run_engine(config, prompts, speculative=True, progress=progress)
    return Report(
        config=config,
        questions=asked,
        plain=plain,
        speculative=spec,
        command=list(command if command is not None else sys.argv),
    )


def format_report(report: Report) -> str:
    """The figures as text, one per line."""
    acc = report.acceptance
    plain, spec = report.plain.timing, report.speculative.timing
    config = report.config
    requests = "greedy" if report.greedy else f"temperature {config.temperature:g}"
    identical = "yes" if report.outputs_identical else "NO"
    median = f"the median of {config.passes} passes" if config.passes > 1 else "one pass"

    def speed(timing: Timing) -> str:
        at = timing.median_pass
        spread = (
            f"; passes {min(timing.rates):.1f}-{max(timing.rates):.1f}"
            if len(timing.rates) > 1
            else ""
        )
        return (
            f"{timing.tokens_per_s:8.1f}  ({timing.tokens[at]} tokens in "
            f"{timing.seconds[at]:.2f} s, {median}{spread})"
        )

    lines = [
        f"{len(report.questions)} prompts, max_tokens={config.max_tokens}, {requests}, "
        f"{config.dtype}, k={config.k}, {config.draft_method} drafts, "
        f"batch size {config.batch_size}",
        "outputs identical with and without speculation: "
        + (identical if report.greedy else "not compared (sampled requests)"),
        "acceptance rate by draft position: "
        + ", ".join(f"{i + 1}: {r:.3f}" for i, r in enumerate(acc.rate_per_position)),
        f"drafted tokens accepted: {acc.num_accepted_tokens} / {acc.num_draft_tokens} "
        f"({acc.acceptance_rate:.3f}) over {acc.num_drafts} target steps with drafts",
        f"mean accepted length (tokens per target step): {acc.mean_accepted_length:.2f}",
        f"tokens/s without speculation: {speed(plain)}",
        f"tokens/s with speculation:    {speed(spec)}",
        f"speed-up: {report.speedup:.2f}x",
    ]
    return "\n".join(lines)


def write_report(report: Report, out: Path) -> tuple[Path, Path]:
    """Write ``acceptance.json`` and ``acceptance.png`` into ``out``; returns both paths."""
    from gemma4_spec.report_plot import plot_acceptance

    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / JSON_NAME, out / PNG_NAME
    json_path.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    acc = report.acceptance
    title = (
        f"k={report.config.k}, {len(report.questions)} prompts: mean accepted length "
        f"{acc.mean_accepted_length:.2f}, speed-up {report.speedup:.2f}x"
    )
    plot_acceptance(acc.rate_per_position, png_path, title=title)
    return json_path, png_path
