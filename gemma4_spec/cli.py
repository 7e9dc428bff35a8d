"""``gemma4-spec`` command line: the demo, the acceptance report, ``serve`` (vLLM's server), the
checkpoint builders."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_WORKDIR = Path("runs/tiny")
PASSES_HELP = "timed passes over the prompts, each engine; tokens/s is the median pass's"
# What the input checks raise (a count below 1, a missing checkpoint, an assistant that does not
# fit, a missing optional package): reported in one line with exit status 2, as argparse does
# for a bad flag. Anything raised later is a defect and keeps its traceback.
_INPUT_ERRORS = (ValueError, OSError, ImportError)


def _refuse(command: str, error: Exception) -> int:
    print(f"gemma4-spec {command}: {error}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    # The demo's own summary is what matters here; VLLM_LOGGING_LEVEL=INFO brings vLLM's back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from gemma4_spec.data import gsm8k
    from gemma4_spec.report import ReportConfig, check_config, format_report, run_report

    target, assistant = _shipped_pair(args)
    print(f"Gemma 4 target:    {target}")
    print(f"Gemma 4 assistant: {assistant} (k={args.k} drafts per target step)")
    try:
        problems = gsm8k.load("test", limit=args.num_prompts, folder=args.gsm8k)
        config = ReportConfig(
            target=target,
            assistant=assistant,
            k=args.k,
            num_prompts=len(problems) or args.num_prompts,  # the count asked, if it is bad
            max_tokens=args.max_tokens,
            passes=args.passes,
        )
        check_config(config)
        if not problems:
            folder = gsm8k.gsm8k_dir(args.gsm8k)
            raise ValueError(f"{folder / 'test.jsonl'} holds no GSM8k questions")
    except _INPUT_ERRORS as error:
        return _refuse("demo", error)
    report = run_report(config, questions=[p.question for p in problems])
    print("\n" + "=" * 72)
    print(f"GSM8k question: {problems[0].question}")
    print(f"answer (greedy, with speculative decoding): {report.speculative.texts[0].strip()}")
    print(f"GSM8k's answer: {problems[0].final_answer}")
    print("-" * 72)
    print(format_report(report))
    print("=" * 72)
    return 0 if report.outputs_identical else 1


def _shipped_pair(args: argparse.Namespace) -> tuple[str, str]:
    """``--target``/``--assistant``, each defaulting to the shipped tiny GSM8k pair's."""
    if args.target is not None and args.assistant is not None:
        return str(args.target), str(args.assistant)
    from gemma4_spec.assets import tiny_gsm8k_pair

    target, assistant = tiny_gsm8k_pair()
    return str(args.target or target), str(args.assistant or assistant)


def _report(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from gemma4_spec.report import (
        ReportConfig,
        check_config,
        format_report,
        gsm8k_questions,
        run_report,
        write_report,
    )
    from gemma4_spec.report_plot import require_matplotlib

    target, assistant = _shipped_pair(args)
    config = ReportConfig(
        target=target,
        assistant=assistant,
        k=args.k,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        batch_size=args.batch_size,
        gsm8k=args.gsm8k,
        temperature=args.temperature,
        draft_method=args.draft_method,
        passes=args.passes,
    )
    try:
        check_config(config)
        require_matplotlib()
        questions = gsm8k_questions(config.num_prompts, config.gsm8k)
    except _INPUT_ERRORS as error:
        return _refuse("report", error)
    report = run_report(config, questions=questions, command=["gemma4-spec", *sys.argv[1:]])
    print(format_report(report))
    json_path, png_path = write_report(report, args.out)
    print(f"wrote {json_path} and {png_path}")
    return 0 if report.outputs_identical or not report.greedy else 1


def _build_tiny(args: argparse.Namespace) -> int:
    from gemma4_spec.testing.tiny import build_tiny_pair

    target, assistant = build_tiny_pair(
        args.workdir, centroids=not args.no_centroids, style=args.style, seed=args.seed
    )
    print(f"target:    {target}\nassistant: {assistant}")
    return 0


def _build_gsm8k_pair(args: argparse.Namespace) -> int:
    import time

    from gemma4_spec.training.build import Budget, build_pair

    overrides = {
        name: getattr(args, name)
        for name in ("target_steps", "distill_prompts", "assistant_steps", "centroid_steps")
        if getattr(args, name) is not None
    }
    from gemma4_spec.data import gsm8k

    try:  # the training data first, not minutes into the build
        gsm8k.load("train", limit=1, folder=args.gsm8k)
    except _INPUT_ERRORS as error:
        return _refuse("build-gsm8k-pair", error)
    start = time.perf_counter()
    target, assistant = build_pair(
        args.out, gsm8k_folder=args.gsm8k, seed=args.seed, budget=Budget(**overrides)
    )
    print(f"target:    {target}\nassistant: {assistant}")
    print(f"built in {time.perf_counter() - start:.0f} s")
    return 0


def _serve(args: list[str]) -> int:
    from gemma4_spec.serve import VllmNotInstalledError, serve

    try:
        return serve(args)
    except VllmNotInstalledError as error:
        print(f"gemma4-spec serve: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # Every argument, --help included, is vLLM's: they go to `vllm serve` untouched.
        return _serve(argv[1:])
    parser = argparse.ArgumentParser(prog="gemma4-spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server: `vllm serve` with the same arguments, "
        "which also starts with vLLM's CPU build (see gemma4_spec.serve)",
        add_help=False,
    )

    demo = sub.add_parser(
        "demo", help="GSM8k questions answered with and without speculation (shipped tiny pair)"
    )
    demo.add_argument("--target", type=Path, help="default: the shipped tiny GSM8k target")
    demo.add_argument("--assistant", type=Path, help="default: the shipped tiny assistant")
    demo.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    demo.add_argument("--num-prompts", type=int, default=4, help="first N GSM8k test questions")
    demo.add_argument("--max-tokens", type=int, default=128)
    demo.add_argument("--gsm8k", help="GSM8k folder (default: the copy shipped in the package)")
    demo.add_argument("--passes", type=int, default=3, help=PASSES_HELP)
    demo.set_defaults(func=_demo)

    report = sub.add_parser(
        "report",
        help="acceptance by draft position, mean accepted length and speed-up on GSM8k prompts",
    )
    report.add_argument("--target", type=Path, help="default: the shipped tiny GSM8k target")
    report.add_argument("--assistant", type=Path, help="default: the shipped tiny assistant")
    report.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    report.add_argument("--num-prompts", type=int, default=16, help="first N GSM8k test questions")
    report.add_argument("--max-tokens", type=int, default=128)
    report.add_argument("--batch-size", type=int, default=1, help="requests per generate call")
    report.add_argument("--dtype", default="float32")
    report.add_argument("--gsm8k", help="GSM8k folder (default: the copy shipped in the package)")
    report.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (outputs must match)"
    )
    report.add_argument(
        "--draft-method", choices=("greedy", "probabilistic"), default="greedy",
        help="vLLM's draft_sample_method",
    )  # fmt: skip
    report.add_argument("--passes", type=int, default=3, help=PASSES_HELP)
    report.add_argument("--out", type=Path, default=Path("runs/report"), help="output folder")
    report.set_defaults(func=_report)

    tiny = sub.add_parser("build-tiny", help="write a random tiny Gemma 4 target + assistant")
    tiny.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    tiny.add_argument("--style", choices=["copy", "random"], default="copy")
    tiny.add_argument("--no-centroids", action="store_true")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_build_tiny)

    pair = sub.add_parser(
        "build-gsm8k-pair",
        help="train a small Gemma 4 target + assistant (and tokenizer) on GSM8k (CPU, minutes)",
    )
    pair.add_argument("--out", type=Path, required=True, help="writes OUT/target, OUT/assistant")
    pair.add_argument("--gsm8k", help="folder with train.jsonl (default: the shipped copy)")
    pair.add_argument("--seed", type=int, default=0)
    budget = pair.add_argument_group("budget (defaults build the shipped pair)")
    for flag in ("--target-steps", "--distill-prompts", "--assistant-steps", "--centroid-steps"):
        budget.add_argument(flag, type=int)
    pair.set_defaults(func=_build_gsm8k_pair)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
