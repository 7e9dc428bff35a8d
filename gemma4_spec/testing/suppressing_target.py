"""A text-only Gemma 4 target that suppresses tokens the way vLLM 0.26's multimodal one does.

The published Gemma 4 checkpoints load as vLLM's ``Gemma4ForConditionalGeneration``, whose
``compute_logits`` takes its language model's logits and then sets the generation config's
``suppress_tokens`` to ``-inf`` by indexing with a Python list. That class needs transformers'
image processor (torchvision) to import, which the GPU machine lacks. This one is vLLM's
text-only ``Gemma4ForCausalLM`` with the two things the plugin's V2 verification meets in the
multimodal class: ``get_language_model()``, whose ``compute_logits`` gives the logits before the
suppression, and the suppression itself, by list indexing, after them. Registered by name
(``RunConfig.register_models``) for a checkpoint whose ``architectures`` is ``ARCHITECTURE`` and
whose ``generation_config.json`` lists ``suppress_tokens`` (``write_suppressing_target``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ARCHITECTURE = "Gemma4SuppressingForCausalLM"
MODEL_CLASS = f"{__name__}:SuppressingGemma4ForCausalLM"


def write_suppressing_target(path: str | Path, suppressed: Sequence[int]) -> None:
    """Make the text-only target checkpoint at ``path`` load as ``ARCHITECTURE``, suppressing
    ``suppressed``."""
    path = Path(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [ARCHITECTURE]
    config_file.write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"suppress_tokens": [int(t) for t in suppressed]})
    )


def tokens_to_suppress(continuations: Sequence[Sequence[int]]) -> list[int]:
    """What a test target suppresses, from its greedy ``continuations`` without suppression:
    the second token of the first and the last one. They change from there on; the others keep
    their tokens (and the repeats the copy assistant's drafts get accepted on)."""
    return sorted({continuations[0][1], continuations[-1][1]})


def build_suppressing_pair(
    root: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int
) -> tuple[Path, Path, list[int]]:
    """An E2B-shaped text-only target under ``root`` (the default seed's weights) suppressing
    ``tokens_to_suppress`` of transformers' greedy continuations of ``prompts``, and a copy-style
    centroid assistant for it: (target, assistant, suppressed tokens)."""
    from gemma4_spec.testing.tiny import (
        build_tiny_assistant,
        build_tiny_e2b_like_target,
        hf_greedy_tokens,
    )

    root = Path(root)
    target = build_tiny_e2b_like_target(root / "target", multimodal=False)
    suppressed = tokens_to_suppress(hf_greedy_tokens(target, prompts, max_tokens))
    write_suppressing_target(target, suppressed)
    assistant = build_tiny_assistant(root / "assistant", target, centroids=True)
    return target, assistant, suppressed


@functools.cache
def _model_class() -> type:
    import torch
    from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM

    class _LanguageModel:
        """The target seen as the multimodal class's language model: its logits before the
        suppression, and everything else (``model.embed_tokens``, ``lm_head``, which drafters
        share) the target's own. Not a submodule: no weights of its own."""

        def __init__(self, model: Any) -> None:
            self._model = model

        def __getattr__(self, name: str) -> Any:
            if name == "_model":  # not set yet (a copy being built): no recursion through it
                raise AttributeError(name)
            return getattr(self._model, name)

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            return Gemma4ForCausalLM.compute_logits(self._model, hidden_states)

    class SuppressingGemma4ForCausalLM(Gemma4ForCausalLM):
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            generation = vllm_config.model_config.try_get_generation_config()
            self._suppress_token_ids = generation.get("suppress_tokens") if generation else None
            self._language_model = _LanguageModel(self)

        def get_language_model(self) -> Any:
            return self._language_model

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            logits = super().compute_logits(hidden_states)
            if logits is not None and self._suppress_token_ids:
                logits[:, self._suppress_token_ids] = float("-inf")
            return logits

    return SuppressingGemma4ForCausalLM


def __getattr__(name: str) -> Any:
    # vLLM's registry imports "module:SuppressingGemma4ForCausalLM" in the engine's process;
    # the class is built then (once), so importing this module needs no vLLM.
    if name == "SuppressingGemma4ForCausalLM":
        return _model_class()
    raise AttributeError(name)
