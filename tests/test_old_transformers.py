"""Our checkpoints read the same with the oldest transformers the supported vLLM range uses.

vLLM 0.26 works with transformers 5.14; the venv has a newer one. ``make compat-transformers``
pip-installs transformers 5.14.1 (and the tokenizers / huggingface-hub it needs) into
``.compat/transformers-5.14.1`` without dependencies, so a subprocess with that folder first on
``PYTHONPATH`` runs it over the venv's torch. Both transformers answer
``gemma4_spec.testing.load_check`` about the same checkpoints, and the answers must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.testing import e2b_shaped
from gemma4_spec.testing.config_format import write_portable_config
from gemma4_spec.testing.families import FAMILIES, build_family_pair, real_shape_configs
from gemma4_spec.testing.load_check import check
from gemma4_spec.testing.tiny import (
    build_tiny_assistant,
    build_tiny_e2b_like_target,
    build_tiny_pair,
)

ROOT = Path(__file__).resolve().parents[1]
OLD_VERSION = "5.14.1"
OLD_DIR = ROOT / ".compat" / f"transformers-{OLD_VERSION}"

pytestmark = pytest.mark.skipif(
    not (OLD_DIR / "transformers").is_dir(),
    reason=f"transformers {OLD_VERSION} is not in {OLD_DIR}: run `make compat-transformers`",
)


def _old_check(specs: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(OLD_DIR), str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "gemma4_spec.testing.load_check", str(out), *specs]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Every kind of checkpoint the project writes or ships."""
    root = tmp_path_factory.mktemp("checkpoints")
    shipped = tiny_gsm8k_pair()
    tiny = build_tiny_pair(root / "tiny")
    e2b_text = build_tiny_e2b_like_target(root / "e2b_text" / "target", multimodal=False)
    e2b_text_assistant = build_tiny_assistant(root / "e2b_text" / "assistant", e2b_text)
    e2b_multimodal = build_tiny_e2b_like_target(root / "e2b_multimodal" / "target")
    e2b_multimodal_assistant = build_tiny_assistant(
        root / "e2b_multimodal" / "assistant", e2b_multimodal
    )
    # E4B-, 26B-A4B- and 31B-like tiny pairs (KV sharing, attention_k_eq_v, MoE).
    families = [build_family_pair(family, root / family) for family in FAMILIES]
    # The E2B-shaped pair's and the other families' published configs only (their weights
    # take a GPU to build), saved as their builders save them.
    real = [(e2b_shaped.target_config(), e2b_shaped.assistant_config())]
    real += [real_shape_configs(family) for family in FAMILIES]
    shaped = []
    for index, configs in enumerate(real):
        for name, config in zip(("target", "assistant"), configs, strict=True):
            folder = root / f"shaped-{index}" / name
            config.save_pretrained(folder)
            shaped.append(write_portable_config(folder).parent)
    return [
        f"pair:{shipped[0]}:{shipped[1]}",
        f"pair:{tiny[0]}:{tiny[1]}",
        f"pair:{e2b_text}:{e2b_text_assistant}",
        f"pair:{e2b_multimodal}:{e2b_multimodal_assistant}",
        *(f"pair:{target}:{assistant}" for target, assistant in families),
        *(f"config:{folder}" for folder in shaped),
    ]


def _without_logits(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k != "draft_logits"}


def test_oldest_transformers_reads_our_checkpoints_as_the_installed_one(
    specs: list[str], tmp_path: Path
) -> None:
    done = _old_check(specs, tmp_path / "old.json")
    assert done.returncode == 0, done.stderr[-4000:]
    old = json.loads((tmp_path / "old.json").read_text())
    # Really the old release, from the folder, not the venv's.
    assert old["transformers"]["version"] == OLD_VERSION
    assert Path(old["transformers"]["file"]).resolve().is_relative_to(OLD_DIR.resolve())

    new = check(specs)
    assert new["transformers"]["version"] != OLD_VERSION
    for spec in specs:
        old_answer, new_answer = old["checks"][spec], new["checks"][spec]
        assert _without_logits(old_answer) == _without_logits(new_answer), spec
        for role in ("target", "assistant"):
            if role in old_answer:  # every weight loaded, none left over, none mis-shaped
                loading = {k: old_answer[role][k] for k in ("missing_keys", "unexpected_keys")}
                assert loading == {"missing_keys": [], "unexpected_keys": []}, (spec, role)
                assert old_answer[role]["mismatched_keys"] == [], (spec, role)
        if "draft_logits" in new_answer:
            pairs = zip(old_answer["draft_logits"], new_answer["draft_logits"], strict=True)
            assert max(abs(a - b) for a, b in pairs) < 1e-3, spec
    assert sum("draft_logits" in new["checks"][s] for s in specs) == 6  # the text-only pairs


def test_per_layer_config_form_is_what_the_oldest_cannot_read(tmp_path: Path) -> None:
    """Control: the shipped target's config as the installed transformers writes it by itself
    (``per_layer_config``) fails under the old release, as the issue reported."""
    target, _ = tiny_gsm8k_pair()
    AutoConfig.from_pretrained(target).save_pretrained(tmp_path / "target")
    assert "per_layer_config" in (tmp_path / "target" / "config.json").read_text()
    done = _old_check([f"config:{tmp_path / 'target'}"], tmp_path / "old.json")
    assert done.returncode != 0
    assert "AmbiguousGlobalPerLayerAttributeError" in done.stderr
