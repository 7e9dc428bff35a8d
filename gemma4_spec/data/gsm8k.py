"""GSM8k: where the project finds it and how it reads it.

The package ships GSM8k (MIT, from openai/grade-school-math) in ``gemma4_spec/assets/gsm8k``,
with its licence and provenance, so every command finds it in any installation. Commands that
take ``--gsm8k DIR`` read that folder instead, and only that one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# The copy inside the installed package (assets/ is package data, see pyproject.toml).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "gsm8k"
SPLITS = ("train", "test")
_FINAL_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the worked solution, ending in "#### <number>"

    @property
    def final_answer(self) -> str:
        return final_answer(self.answer) or ""


def gsm8k_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding ``train.jsonl`` and ``test.jsonl``; a clear error when there is none.

    Without ``explicit`` it is the shipped copy. A folder given explicitly is the only one
    looked at (no silent fallback to the shipped copy)."""
    folder = Path(explicit) if explicit else SHIPPED_DIR
    if (folder / "test.jsonl").is_file() or (folder / "train.jsonl").is_file():
        return folder
    if explicit:
        raise FileNotFoundError(
            f"GSM8k not found in {folder}: the folder given with --gsm8k must hold train.jsonl "
            "and/or test.jsonl (leave --gsm8k out to use the copy shipped with gemma4-spec)."
        )
    raise FileNotFoundError(
        f"GSM8k not found: the copy shipped with gemma4-spec ({folder}) is missing from this "
        "installation. Reinstall the package, or pass a folder holding train.jsonl and "
        "test.jsonl with --gsm8k DIR."
    )


def load(
    split: str, limit: int | None = None, folder: str | os.PathLike[str] | None = None
) -> list[Problem]:
    """The first ``limit`` problems of a split (all of them when ``limit`` is None)."""
    if split not in SPLITS:
        raise ValueError(f"GSM8k split must be one of {SPLITS}, not {split!r}")
    path = gsm8k_dir(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the GSM8k folder has no {split} split.")
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if limit is not None and len(problems) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                problems.append(Problem(question=row["question"], answer=row["answer"]))
    return problems


def final_answer(text: str) -> str | None:
    """The number after the last ``####`` (commas dropped), or None if there is none."""
    found = _FINAL_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None
