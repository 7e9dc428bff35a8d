"""Data and checkpoints shipped with the package.

``gsm8k/`` holds GSM8k (MIT, with its licence and provenance; read through
``gemma4_spec.data.gsm8k``). ``tiny_gsm8k/`` holds a small Gemma 4 target + assistant pair (with
a BPE tokenizer and a chat template) trained on GSM8k, so that the assistant drafts well enough
for an acceptance-rate test.
Rebuild it, from the project root, with:

    .venv/bin/gemma4-spec build-gsm8k-pair --out gemma4_spec/assets/tiny_gsm8k

(it trains on the shipped GSM8k unless ``--gsm8k DIR`` names another copy; ``--seed`` defaults
to 0, and equal seeds give the same pair.)
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_GSM8K_DIR", "tiny_gsm8k_pair"]

TINY_GSM8K_DIR = Path(__file__).resolve().parent / "tiny_gsm8k"
_REBUILD = "gemma4-spec build-gsm8k-pair --out gemma4_spec/assets/tiny_gsm8k"


def tiny_gsm8k_pair() -> tuple[Path, Path]:
    """Paths of the shipped GSM8k-trained tiny pair: ``(target_dir, assistant_dir)``.

    Both are Hugging Face checkpoint folders; the target folder also holds the tokenizer (with a
    chat template). Raises ``FileNotFoundError`` if the pair is missing from this installation.
    """
    target, assistant = TINY_GSM8K_DIR / "target", TINY_GSM8K_DIR / "assistant"
    for folder in (target, assistant):
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"The shipped tiny GSM8k pair is missing ({folder / 'config.json'} not found). "
                f"Rebuild it from the project root with: {_REBUILD}"
            )
    return target, assistant
