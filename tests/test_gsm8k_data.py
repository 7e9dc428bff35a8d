"""Finding and reading GSM8k: the shipped copy, an explicit folder, and clear errors."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from gemma4_spec.data import gsm8k


def test_reads_the_shipped_copy() -> None:
    problems = gsm8k.load("test", limit=3)
    assert len(problems) == 3
    assert problems[0].final_answer == "18"  # Janet's ducks
    assert gsm8k.gsm8k_dir() == gsm8k.SHIPPED_DIR
    # Inside the package, so that any installation (a wheel too) has it.
    assert gsm8k.SHIPPED_DIR.is_relative_to(Path(gsm8k.__file__).resolve().parents[1])


def test_shipped_copy_is_whole_with_its_licence_and_provenance() -> None:
    """Every split has the rows and the sha256 its provenance note records, beside the MIT
    licence it is shipped under."""
    folder = gsm8k.SHIPPED_DIR
    licence = (folder / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "OpenAI" in licence
    provenance = (folder / "README.md").read_text()
    assert "https://github.com/openai/grade-school-math" in provenance
    for split, rows in (("train", 7473), ("test", 1319)):
        name = f"{split}.jsonl"
        recorded = re.search(rf"`{re.escape(name)}` \| (\d+) \| `([0-9a-f]{{64}})`", provenance)
        assert recorded is not None, f"{name} has no row in the provenance note"
        assert int(recorded.group(1)) == rows == len(gsm8k.load(split))
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == recorded.group(2)


def test_explicit_folder_without_data_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--gsm8k"):
        gsm8k.gsm8k_dir(tmp_path)


def test_explicit_folder_is_read(tmp_path: Path) -> None:
    row = {"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"}
    (tmp_path / "test.jsonl").write_text(json.dumps(row) + "\n")
    (problem,) = gsm8k.load("test", folder=tmp_path)
    assert problem.question == "1+1?" and problem.final_answer == "2"
    with pytest.raises(FileNotFoundError, match="no train split"):
        gsm8k.load("train", folder=tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("so #### 1,234", "1234"), ("#### -3.5", "-3.5"), ("#### 1\n#### 7", "7"), ("none", None)],
)
def test_final_answer(text: str, expected: str | None) -> None:
    assert gsm8k.final_answer(text) == expected


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="split"):
        gsm8k.load("validation")


def test_demo_reads_the_folder_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gemma4-spec demo --gsm8k DIR`` reads DIR, not the shipped copy: without data there, or
    with an empty test split, one line and status 2 before any engine starts."""
    from gemma4_spec import report
    from gemma4_spec.cli import main as cli_main

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("an engine would start")

    monkeypatch.setattr(report, "run_report", no_engine)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # what the demo would set for itself
    assert cli_main(["demo", "--gsm8k", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"GSM8k not found in {tmp_path}" in err and "--gsm8k" in err
    (tmp_path / "test.jsonl").write_text("")
    assert cli_main(["demo", "--gsm8k", str(tmp_path)]) == 2
    assert "test.jsonl holds no GSM8k questions" in capsys.readouterr().err
