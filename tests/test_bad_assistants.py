"""Bad target / assistant pairs fail through vLLM's real entry path, before any engine starts.

``EngineArgs(...)`` loads the general plugins (ours among them) in ``__post_init__``, and
``create_engine_config()`` builds the speculative config through the plugin's wrapper of
``EngineArgs.create_speculative_config``, which runs our checks. Each bad case must surface as
our :class:`AssistantMismatchError` naming the values that disagree, not as a vLLM internal
error or a shape error once weights load. Only configs (and one small tensor) are read: no
model is loaded and no engine process is started.

Bad variants are copies of a good tiny assistant with one field of ``config.json`` (or the
``token_ordering`` tensor) changed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from gemma4_spec.patch.hooks import is_ours
from gemma4_spec.testing.families import build_family_pair
from gemma4_spec.testing.tiny import build_tiny_pair
from gemma4_spec.validation import (
    TOKEN_ORDERING_KEY,
    AssistantMismatchError,
    UnsupportedConfigurationError,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bad-assistants")


@pytest.fixture(scope="module")
def pair(root: Path) -> tuple[Path, Path]:
    return build_tiny_pair(root / "good", centroids=True, style="random")


@pytest.fixture(scope="module")
def target(pair: tuple[Path, Path]) -> Path:
    return pair[0]


@pytest.fixture(scope="module")
def variant(root: Path, pair: tuple[Path, Path]) -> Callable[..., Path]:
    """Copy the good assistant to ``root/name`` and apply ``edit`` to its config.json dict."""

    def make(name: str, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
        path = root / name
        shutil.copytree(pair[1], path)
        if edit is not None:
            config_file = path / "config.json"
            config = json.loads(config_file.read_text())
            edit(config)
            config_file.write_text(json.dumps(config, indent=2))
        return path

    return make


def engine_config(target: Path, assistant: Path | None, tensor_parallel_size: int = 1) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    speculative: dict[str, Any] = {"method": "gemma4_mtp", "num_speculative_tokens": 2}
    if assistant is not None:
        speculative["model"] = str(assistant)
    args = EngineArgs(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        tensor_parallel_size=tensor_parallel_size,
        speculative_config=speculative,
    )
    return args.create_engine_config()


def mismatch(target: Path, assistant: Path | None) -> str:
    with pytest.raises(AssistantMismatchError) as info:
        engine_config(target, assistant)
    return str(info.value)


def test_good_pair_passes(pair: tuple[Path, Path]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = engine_config(*pair)
    assert config.speculative_config is not None
    assert config.speculative_config.draft_model_config.hf_config.model_type == "gemma4_mtp"
    # The plugin's wrapper ran (so the failures below are its checks, not vLLM's).
    assert is_ours(EngineArgs.create_speculative_config)


def test_backbone_hidden_size_differs(target: Path, variant: Callable[..., Path]) -> None:
    assistant = variant("backbone", lambda c: c.update(backbone_hidden_size=96))
    message = mismatch(target, assistant)
    assert "backbone_hidden_size=96" in message and "hidden_size=128" in message
    assert str(assistant) in message and str(target) in message


def test_kv_heads_differ(target: Path, variant: Callable[..., Path]) -> None:
    assistant = variant("kv-heads", lambda c: c["text_config"].update(num_key_value_heads=1))
    message = mismatch(target, assistant)
    assert "num_key_value_heads=1 vs 2" in message
    assert "layer 0" in message and "layer 2" in message and "sliding_attention" in message


def test_full_attention_head_dim_differs(target: Path, variant: Callable[..., Path]) -> None:
    def edit(config: dict[str, Any]) -> None:
        text = config["text_config"]
        assert text["global_head_dim"] == 64  # the full-attention layers' head size
        text["global_head_dim"] = 32

    message = mismatch(target, variant("head-dim", edit))
    assert "head_dim=32 vs 64" in message
    assert "layer 1" in message and "layer 3" in message and "full_attention" in message


def test_tensor_parallel_size_not_dividing_the_query_heads(
    target: Path, variant: Callable[..., Path]
) -> None:
    # The target's 4 heads split over 4 ranks, the assistant's 6 do not. vLLM's own check of the
    # draft's heads fails first ("Total number of attention heads (6) must be divisible by
    # tensor parallel size (4)"): ours explains it, naming the assistant and the sizes that work.
    assistant = variant("tp-heads", lambda c: c["text_config"].update(num_attention_heads=6))
    with pytest.raises(UnsupportedConfigurationError) as info:
        engine_config(target, assistant, tensor_parallel_size=4)
    message = str(info.value)
    assert "tensor_parallel_size=4" in message and "num_attention_heads=6" in message
    assert str(assistant) in message and "(1, 2)" in message


def test_tensor_parallel_size_not_dividing_the_mlp(
    target: Path, variant: Callable[..., Path]
) -> None:
    # vLLM checks no draft MLP: without our check this fails in every worker at load.
    assistant = variant("tp-mlp", lambda c: c["text_config"].update(intermediate_size=130))
    with pytest.raises(UnsupportedConfigurationError, match="intermediate_size=130"):
        engine_config(target, assistant, tensor_parallel_size=4)
    assert engine_config(target, assistant, tensor_parallel_size=2).speculative_config


def test_k_eq_v_fields_dropped(root: Path) -> None:
    """A 26B-A4B-like pair (full layers share K and V, 1 KV head against 4 on sliding layers)
    whose assistant config lost the two fields that say so."""
    target, good = build_family_pair("26b-a4b", root / "k-eq-v")
    engine_config(target, good)
    config_file = good / "config.json"
    config = json.loads(config_file.read_text())
    for name in ("attention_k_eq_v", "num_global_key_value_heads"):
        config["text_config"].pop(name)
    config_file.write_text(json.dumps(config, indent=2))

    message = mismatch(target, good)
    assert "layer 1 ('full_attention')" in message and "num_key_value_heads=4 vs 1" in message
    assert "attention_k_eq_v: true and num_global_key_value_heads: 1" in message


def test_vocab_differs(target: Path, variant: Callable[..., Path]) -> None:
    assistant = variant("vocab", lambda c: c["text_config"].update(vocab_size=4096))
    message = mismatch(target, assistant)
    assert "vocab_size=4096" in message and "vocab_size=2048" in message


def test_vocab_not_divisible_by_num_centroids(target: Path, variant: Callable[..., Path]) -> None:
    message = mismatch(target, variant("centroids", lambda c: c.update(num_centroids=60)))
    assert "num_centroids=60" in message and "vocab_size=2048" in message


def test_token_ordering_not_a_permutation(target: Path, variant: Callable[..., Path]) -> None:
    assistant = variant("zero-ordering")
    weights_file = assistant / "model.safetensors"
    tensors = load_file(weights_file)
    # As transformers leaves the buffer when nothing fills it in.
    tensors[TOKEN_ORDERING_KEY] = torch.zeros_like(tensors[TOKEN_ORDERING_KEY])
    save_file(tensors, weights_file, metadata={"format": "pt"})

    message = mismatch(target, assistant)
    assert TOKEN_ORDERING_KEY in message and "not a permutation of range(2048)" in message
    assert "all zeros" in message


def test_rope_parameters_differ(target: Path, variant: Callable[..., Path]) -> None:
    def edit(config: dict[str, Any]) -> None:
        config["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] = 10_000.0

    message = mismatch(target, variant("rope", edit))
    assert "'full_attention'" in message
    assert "'rope_theta': 10000.0" in message and "'rope_theta': 1000000.0" in message


def test_target_not_gemma4(root: Path, pair: tuple[Path, Path]) -> None:
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with torch.random.fork_rng(devices=[]):
        llama = LlamaForCausalLM(config)
    llama_dir = root / "llama"
    llama.save_pretrained(llama_dir)

    message = mismatch(llama_dir, pair[1])
    assert "not a Gemma 4 model" in message
    assert "'llama'" in message and "LlamaForCausalLM" in message


def test_draft_is_not_an_assistant(target: Path) -> None:
    # vLLM 0.32 rejects this itself ("Unsupported speculative method: 'mtp'"); the plugin
    # explains it with our checks, chained to vLLM's error.
    message = mismatch(target, target)
    assert "not a Gemma 4 assistant" in message and "'gemma4_text'" in message


def test_no_assistant_given(target: Path) -> None:
    # Without "model" vLLM drafts with the target itself and fails as above.
    message = mismatch(target, None)
    assert "needs an assistant checkpoint" in message
