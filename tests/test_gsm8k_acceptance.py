"""Acceptance of Gemma 4 MTP drafts on GSM8k through vLLM with our plugin.

* The shipped GSM8k-trained tiny pair, k=3, greedy float32, the first 64 test questions: at least
  half of the drafted tokens are accepted, and the output is the plain run's, token for token.
* Opt-in, real checkpoints (``GEMMA4_SPEC_TARGET`` and ``GEMMA4_SPEC_ASSISTANT``: local folders
  or hub ids, e.g. ``google/gemma-4-E4B-it`` and ``google/gemma-4-E4B-it-assistant``): 5-shot
  GSM8k accuracy with speculation over all 1319 test questions is at least 0.5.

The figures (acceptance rate, mean acceptance length, per-position rates) are printed in the
terminal summary of the run.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.data import gsm8k
from gemma4_spec.testing.engine_run import (
    PLUGIN_PROPOSER,
    RunConfig,
    RunResult,
    generate_in_subprocess,
)
from gemma4_spec.training.corpus import prompt_ids

pytestmark = pytest.mark.engine

NUM_QUESTIONS = 64
MAX_TOKENS = 96
K = 3
MIN_ACCEPTANCE = 0.5

TARGET_ENV, ASSISTANT_ENV = "GEMMA4_SPEC_TARGET", "GEMMA4_SPEC_ASSISTANT"
NUM_SHOTS = 5
REAL_MAX_TOKENS = 512
MIN_REAL_ACCURACY = 0.5


def _describe(result: RunResult) -> str:
    acc = result.acceptance
    positions = ", ".join(f"{r:.3f}" for r in acc.rate_per_position) if acc.num_drafts else "-"
    return (
        f"acceptance rate {acc.acceptance_rate:.3f} "
        f"({acc.num_accepted_tokens} of {acc.num_draft_tokens} drafted tokens); "
        f"mean acceptance length {acc.mean_accepted_length:.2f}; "
        f"accepted by draft position: {positions}"
    )


def test_tiny_pair_acceptance_on_gsm8k(report_figure: Callable[[str], None]) -> None:
    target, assistant = tiny_gsm8k_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    questions = gsm8k.load("test", limit=NUM_QUESTIONS)
    assert len(questions) == NUM_QUESTIONS
    prompts = [prompt_ids(tokenizer, p.question) for p in questions]
    common = dict(target=str(target), prompts=prompts, max_tokens=MAX_TOKENS)
    plain, spec = generate_in_subprocess(
        [
            RunConfig(**common),
            RunConfig(**common, assistant=str(assistant), num_speculative_tokens=K),
        ]
    )
    report_figure(
        f"tiny GSM8k pair, k={K}, greedy float32, {NUM_QUESTIONS} test questions x "
        f"{MAX_TOKENS} tokens: {_describe(spec)}"
    )
    assert spec.proposer_class == PLUGIN_PROPOSER
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance_rate >= MIN_ACCEPTANCE


def _five_shot_prompt(
    tokenizer: PreTrainedTokenizerBase, shots: list[gsm8k.Problem], question: str
) -> str:
    messages: list[dict[str, str]] = []
    for shot in shots:
        messages += [
            {"role": "user", "content": shot.question},
            {"role": "assistant", "content": shot.answer},
        ]
    messages.append({"role": "user", "content": question})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    return rendered


@pytest.mark.skipif(
    not (os.environ.get(TARGET_ENV) and os.environ.get(ASSISTANT_ENV)),
    reason=f"real Gemma 4 checkpoints not given: set {TARGET_ENV} and {ASSISTANT_ENV} (local "
    "folders or hub ids, e.g. google/gemma-4-E4B-it and google/gemma-4-E4B-it-assistant) to run "
    "5-shot GSM8k with speculative decoding",
)
def test_real_checkpoints_gsm8k_five_shot(report_figure: Callable[[str], None]) -> None:
    """Run in this process (it needs a real accelerator or a large CPU machine)."""
    from vllm import LLM, SamplingParams

    from gemma4_spec.metrics import spec_metrics

    target, assistant = os.environ[TARGET_ENV], os.environ[ASSISTANT_ENV]
    shots = gsm8k.load("train", limit=NUM_SHOTS)
    problems = gsm8k.load("test")
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [_five_shot_prompt(tokenizer, shots, p.question) for p in problems]
    llm = LLM(
        model=target,
        speculative_config={
            "method": "gemma4_mtp",
            "model": assistant,
            "num_speculative_tokens": K,
        },
        max_model_len=4096,
        disable_log_stats=False,
    )
    outputs = llm.generate(
        # The template already starts with <bos>: the tokenizer must not add a second one.
        [
            {"prompt_token_ids": tokenizer(p, add_special_tokens=False)["input_ids"]}
            for p in prompts
        ],
        SamplingParams(temperature=0.0, max_tokens=REAL_MAX_TOKENS),
    )
    result = RunResult(token_ids=[], spec_metrics=spec_metrics(llm.get_metrics()))
    correct = sum(
        gsm8k.final_answer(out.outputs[0].text) == problem.final_answer
        for out, problem in zip(outputs, problems, strict=True)
    )
    accuracy = correct / len(problems)
    report_figure(
        f"{target} + {assistant}, k={K}, 5-shot GSM8k: accuracy {accuracy:.3f} "
        f"({correct}/{len(problems)}); {_describe(result)}"
    )
    assert accuracy >= MIN_REAL_ACCURACY
