"""What the installed transformers makes of our Gemma 4 checkpoints, as JSON.

Run as ``python -m gemma4_spec.testing.load_check OUT.json SPEC...`` under one transformers and
again under another (``tests/test_old_transformers.py`` does it with transformers 5.14.1 on
``PYTHONPATH``); equal answers mean both read the checkpoints the same way. Each SPEC is

* ``pair:TARGET:ASSISTANT``: both configs, every layer's attention shape, our pair validation,
  both models loaded (with transformers' report of missing, unexpected and mis-shaped weights),
  the target's tokenizer and chat template when it has one, and, for a text-only target, the
  draft logits of one transformers-reference draft step on a fixed prompt;
* ``load:DIR``: the config, layer shapes and the model loaded through its architecture's class;
* ``config:DIR``: the config and layer shapes only (checkpoints too large to load here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# A fixed prompt of token ids below every tiny vocabulary (bos first).
_PROMPT = [2, *range(10, 200, 10)]


def _layer_shapes(folder: str) -> dict[str, Any]:
    from transformers import AutoConfig

    from gemma4_spec.validation import layer_attention_shape

    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    shapes = [list(layer_attention_shape(text, i)) for i in range(text.num_hidden_layers)]
    return {"model_type": config.model_type, "layers": shapes}


def _load(folder: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig

    architecture = AutoConfig.from_pretrained(folder).architectures[0]
    model_class = getattr(transformers, architecture)
    _, info = model_class.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    return {
        "class": architecture,
        **{key: sorted(str(item) for item in info.get(key, [])) for key in _LOADING_KEYS},
    }


_LOADING_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys")


def _pair(target: str, assistant: str) -> dict[str, Any]:
    from transformers import AutoConfig

    from gemma4_spec.testing.tiny import hf_draft_step
    from gemma4_spec.validation import validate_pair

    target_config = AutoConfig.from_pretrained(target)
    validate_pair(target_config, AutoConfig.from_pretrained(assistant))
    result: dict[str, Any] = {
        "target": {**_layer_shapes(target), **_load(target)},
        "assistant": {**_layer_shapes(assistant), **_load(assistant)},
    }
    if target_config.model_type == "gemma4_text":  # the reference step loads a text-only target
        step = hf_draft_step(target, assistant, _PROMPT)
        result["draft_token"] = step.token_id
        result["draft_logits"] = [round(x, 4) for x in step.logits.flatten().tolist()]
    if (Path(target) / "tokenizer.json").is_file():
        result["tokenizer"] = _tokenizer(target)
    return result


def _tokenizer(folder: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "Janet has 16 eggs."
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {"size": len(tokenizer), "ids": tokenizer(text)["input_ids"], "chat": rendered}


def check(specs: list[str]) -> dict[str, Any]:
    """The answer for every SPEC (see the module docstring), keyed by SPEC."""
    import transformers

    results: dict[str, Any] = {}
    for spec in specs:
        kind, _, rest = spec.partition(":")
        if kind == "pair" and rest.count(":") == 1:
            results[spec] = _pair(*rest.split(":"))
        elif kind == "load" and rest:
            results[spec] = {**_layer_shapes(rest), **_load(rest)}
        elif kind == "config" and rest:
            results[spec] = _layer_shapes(rest)
        else:
            raise ValueError(
                f"bad spec {spec!r}: want pair:TARGET:ASSISTANT, load:DIR or config:DIR"
            )
    return {
        "transformers": {"version": transformers.__version__, "file": transformers.__file__},
        "checks": results,
    }


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    Path(argv[0]).write_text(json.dumps(check(argv[1:]), indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
