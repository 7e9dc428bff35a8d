"""End to end on vLLM's CPU backend with a target shaped like Gemma 4 E2B (google/gemma-4-E2B-it).

Unlike the tiny text-only target of test_engine_e2e.py, this one has what real E2B/E4B targets
have: the multimodal ``Gemma4ForConditionalGeneration`` checkpoint layout (``gemma4`` config with a
nested ``text_config`` and a vision tower; text weights under ``model.language_model.``),
per-layer input embeddings, KV-shared last layers and double-wide MLPs on those layers.

How vLLM loads it depends on the environment. vLLM's ``Gemma4ForConditionalGeneration``
(``gemma4_mm``) imports transformers' ``Gemma4Processor``, whose image processor needs
torchvision; a CPU-only torch has no usable torchvision on PyPI (the PyPI wheels link the CUDA
libtorch). Where the processor imports, the target runs as ``Gemma4ForConditionalGeneration``
with ``language_model_only`` (text-only prompts; its multimodal processor would also need a
tokenizer, and we run with ``skip_tokenizer_init``). Elsewhere ``hf_overrides`` makes vLLM load
the same multimodal checkpoint with its text-only ``Gemma4ForCausalLM``, which maps
``model.language_model.*`` onto its own weights and skips the towers.

float32 throughout; the "copy" assistant drafts "the next token repeats this one", so some
drafts are accepted and most are rejected.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from gemma4_spec.testing.engine_run import (
    IN_TREE_PROPOSER,
    PLUGIN_PROPOSER,
    RunConfig,
    RunResult,
    generate_in_subprocess,
)
from gemma4_spec.testing.tiny import (
    FULL,
    SLIDING,
    build_tiny_assistant,
    build_tiny_e2b_like_target,
    hf_greedy_tokens,
)

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (5, 20, 37)  # the last two are longer than the sliding window (16)
MAX_TOKENS = 24
SPEC_TOKENS = 3
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def _multimodal_class_importable() -> bool:
    """Whether vLLM's gemma4_mm can be imported here (it needs transformers' Gemma4Processor)."""
    try:
        from transformers.models.gemma4 import Gemma4Processor  # noqa: F401
    except Exception:  # ModuleNotFoundError without torchvision, RuntimeError with a CUDA build
        return False
    return True


MULTIMODAL_CLASS = _multimodal_class_importable()
TARGET_ENGINE_KWARGS: dict[str, Any] = (
    {"language_model_only": True}
    if MULTIMODAL_CLASS
    else {"hf_overrides": {"architectures": ["Gemma4ForCausalLM"]}}
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2b-like")
    target = build_tiny_e2b_like_target(root / "target", multimodal=True)
    return {
        "target": target,
        "centroids": build_tiny_assistant(root / "centroids", target, centroids=True, style="copy"),
        "full-vocab": build_tiny_assistant(
            root / "full-vocab", target, centroids=False, style="copy"
        ),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, Path], prompts: list[list[int]]) -> dict[str, RunResult]:
    """plain and ours (centroids, full vocab) in one process; the in-tree proposer in another."""

    def config(assistant: str | None = None) -> RunConfig:
        return RunConfig(
            target=str(checkpoints["target"]),
            prompts=prompts,
            assistant=None if assistant is None else str(checkpoints[assistant]),
            num_speculative_tokens=SPEC_TOKENS,
            max_tokens=MAX_TOKENS,
            extra_engine_kwargs=TARGET_ENGINE_KWARGS,
        )

    names = ["plain", "centroids", "full-vocab"]
    ours = generate_in_subprocess([config(), config("centroids"), config("full-vocab")])
    results = dict(zip(names, ours, strict=True))
    (results["in-tree-full-vocab"],) = generate_in_subprocess(
        [config("full-vocab")], plugins="none"
    )
    return results


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_checkpoint_is_e2b_shaped(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    target = checkpoints["target"]
    config = AutoConfig.from_pretrained(target)
    assert config.model_type == "gemma4"
    assert config.architectures == ["Gemma4ForConditionalGeneration"]
    assert config.vision_config is not None and config.audio_config is None
    text = config.text_config
    assert (text.hidden_size_per_layer_input, text.vocab_size_per_layer_input) == (16, 2048)
    assert text.layer_types == [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL]
    assert text.num_kv_shared_layers == 2 and text.use_double_wide_mlp

    tensors = _tensors(target)
    prefix = "model.language_model."
    assert tensors[prefix + "embed_tokens_per_layer.weight"].shape == (2048, 6 * 16)
    assert prefix + "layers.3.self_attn.k_proj.weight" in tensors
    assert prefix + "layers.4.self_attn.k_proj.weight" not in tensors  # KV-shared
    assert tensors[prefix + "layers.3.mlp.gate_proj.weight"].shape == (256, 128)
    assert tensors[prefix + "layers.4.mlp.gate_proj.weight"].shape == (512, 128)  # double-wide
    assert any(name.startswith("model.vision_tower.") for name in tensors)
    _, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    # The text-only layout holds the same text weights, and gives the same assistant.
    text_only = build_tiny_e2b_like_target(tmp_path / "text-only", multimodal=False)
    assert AutoConfig.from_pretrained(text_only).model_type == "gemma4_text"
    for name, tensor in _tensors(text_only).items():
        assert torch.equal(tensor, tensors[prefix + name.removeprefix("model.")]), name
    assistant = build_tiny_assistant(tmp_path / "assistant", text_only, centroids=True)
    centroids = checkpoints["centroids"]
    assert (assistant / "model.safetensors").read_bytes() == (
        centroids / "model.safetensors"
    ).read_bytes()


def test_plain_vllm_matches_transformers(
    runs: dict[str, RunResult], checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    expected = hf_greedy_tokens(checkpoints["target"], prompts, MAX_TOKENS)
    assert runs["plain"].token_ids == expected
    assert all(len(set(tokens)) > MAX_TOKENS // 2 for tokens in expected)  # not degenerate


@pytest.mark.parametrize("kind", ["centroids", "full-vocab"])
def test_greedy_output_equals_no_speculation(runs: dict[str, RunResult], kind: str) -> None:
    spec = runs[kind]
    assert spec.proposer_class == PLUGIN_PROPOSER
    assert spec.token_ids == runs["plain"].token_ids
    assert all(len(tokens) == MAX_TOKENS for tokens in spec.token_ids)


@pytest.mark.parametrize("kind", ["centroids", "full-vocab"])
def test_drafts_are_accepted(runs: dict[str, RunResult], kind: str) -> None:
    m = runs[kind].spec_metrics
    assert m[NUM_DRAFTS] > 0
    assert m[NUM_DRAFT_TOKENS] == SPEC_TOKENS * m[NUM_DRAFTS]
    assert 0 < m[NUM_ACCEPTED] < m[NUM_DRAFT_TOKENS], m


def test_same_tokens_and_counters_as_in_tree(runs: dict[str, RunResult]) -> None:
    ours, in_tree = runs["full-vocab"], runs["in-tree-full-vocab"]
    assert in_tree.proposer_class == IN_TREE_PROPOSER  # VLLM_PLUGINS=none: the plugin is off
    assert ours.token_ids == in_tree.token_ids
    assert ours.spec_metrics == in_tree.spec_metrics
