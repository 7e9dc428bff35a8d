"""GSM8k: where the project finds it and how it reads it.

The data set is not shipped with the package. Commands take ``--gsm8k DIR``; without it they look
in ``$GEMMA4_SPEC_GSM8K``, then in ``shared/data/gsm8k`` beside the project's checkout.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "GEMMA4_SPEC_GSM8K"
# The checkout's root is two levels above this package; shared/ lies beside the checkout.
_BESIDE_CHECKOUT = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
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

    A folder given explicitly is the only one looked at (no silent fallback to another)."""
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = [Path(p) for p in (os.environ.get(ENV_VAR),) if p]
        candidates.append(_BESIDE_CHECKOUT)
    for folder in candidates:
        if (folder / "test.jsonl").is_file() or (folder / "train.jsonl").is_file():
            return folder
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"GSM8k not found (looked in: {tried}). Pass the folder holding train.jsonl and "
        f"test.jsonl with --gsm8k DIR or set {ENV_VAR}=DIR."
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
