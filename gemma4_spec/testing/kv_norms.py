"""Give a saved target a ``k_norm`` weight on every layer, as vLLM 0.26 expects.

transformers saves no ``k_norm`` for KV-shared layers (they compute no K), and vLLM 0.26's
Gemma 4 reports those weights as not initialised from the checkpoint; later vLLM versions skip
them. For test and benchmark checkpoints we add ones (the norm's identity) in a side file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from gemma4_spec.validation import layer_attention_shape

SIDE_FILE = "model-extra-k-norm.safetensors"


def add_missing_k_norms(path: str | Path, prefix: str = "model.") -> list[str]:
    """Add the missing ``{prefix}layers.N.self_attn.k_norm.weight``; returns their names."""
    path = Path(path)
    text_config = AutoConfig.from_pretrained(path).get_text_config()
    present: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            present.update(handle.keys())
    dtype = _checkpoint_dtype(text_config)
    missing = {}
    for i in range(text_config.num_hidden_layers):
        name = f"{prefix}layers.{i}.self_attn.k_norm.weight"
        if name not in present:
            head_dim = layer_attention_shape(text_config, i)[1]
            missing[name] = torch.ones(head_dim, dtype=dtype)
    if not missing:
        return []
    save_file(missing, str(path / SIDE_FILE), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"].update(dict.fromkeys(missing, SIDE_FILE))
        index_file.write_text(json.dumps(index, indent=2))
    return sorted(missing)


def _checkpoint_dtype(text_config: object) -> torch.dtype:
    dtype = getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype), torch.float32) if dtype else torch.float32
