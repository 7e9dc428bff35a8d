"""End to end on vLLM's CPU backend: a target that suppresses tokens as the published Gemma 4
checkpoints' class does (``testing/suppressing_target.py``, the GPU engine test's stand-in for
it) never emits them, and our speculative decoding gives its plain decoding's tokens.

The stand-in is registered with vLLM by name in the engine's process; here it is checked to
load, read the checkpoint's ``suppress_tokens`` and bite (the same weights without the list
decode otherwise). float32; the E2B-shaped target soft-caps its logits as the real ones do.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from gemma4_spec.testing.engine_run import PLUGIN_PROPOSER, RunConfig, generate_in_subprocess
from gemma4_spec.testing.suppressing_target import (
    ARCHITECTURE,
    MODEL_CLASS,
    build_suppressing_pair,
)
from gemma4_spec.testing.tiny import build_tiny_e2b_like_target

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (5, 20, 37)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("suppress")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]
    free = build_tiny_e2b_like_target(root / "free", multimodal=False)
    target, assistant, suppressed = build_suppressing_pair(
        root / "suppressing", prompts, MAX_TOKENS
    )
    common: dict[str, Any] = dict(prompts=prompts, max_tokens=MAX_TOKENS)
    registered = dict(common, target=str(target), register_models={ARCHITECTURE: MODEL_CLASS})
    configs = {
        "free": RunConfig(**common, target=str(free)),
        "plain": RunConfig(**registered),
        "ours": RunConfig(**registered, assistant=str(assistant), num_speculative_tokens=3),
    }
    results = dict(zip(configs, generate_in_subprocess(list(configs.values())), strict=True))
    return {"suppressed": suppressed, "target": target, **results}


def test_the_checkpoint_names_the_stand_in(runs: dict[str, Any]) -> None:
    import json

    config = json.loads((Path(runs["target"]) / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]


def test_suppressed_tokens_are_never_emitted(runs: dict[str, Any]) -> None:
    free, plain = runs["free"].token_ids, runs["plain"].token_ids
    suppressed = set(runs["suppressed"])
    assert {t for tokens in free for t in tokens} & suppressed  # they would be, unsuppressed
    assert not {t for tokens in plain for t in tokens} & suppressed
    assert plain != free


def test_speculative_decoding_gives_plain_decodings_tokens(runs: dict[str, Any]) -> None:
    ours = runs["ours"]
    assert ours.proposer_class == PLUGIN_PROPOSER
    assert ours.token_ids == runs["plain"].token_ids
    assert ours.spec_metrics["vllm:spec_decode_num_accepted_tokens"] > 0
