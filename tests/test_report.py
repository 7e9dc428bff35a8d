"""``gemma4-spec report``: its arithmetic, its input checks, one real run on the shipped pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.cli import main
from gemma4_spec.metrics import SPEC_PREFIX, Acceptance
from gemma4_spec.report import JSON_NAME, PNG_NAME, ReportConfig, Timing, check_config
from gemma4_spec.validation import AssistantMismatchError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _counters(drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> dict[str, object]:
    return {
        SPEC_PREFIX + "num_drafts": drafts,
        SPEC_PREFIX + "num_draft_tokens": drafted,
        SPEC_PREFIX + "num_accepted_tokens": accepted,
        SPEC_PREFIX + "num_accepted_tokens_per_pos": per_pos,
    }


def test_acceptance_is_the_counters_growth() -> None:
    before = _counters(2, 6, 3, [2, 1, 0])  # e.g. a warm-up request
    after = _counters(12, 36, 13, [8, 4, 1])
    acc = Acceptance.between(before, after)
    assert (acc.num_drafts, acc.num_draft_tokens, acc.num_accepted_tokens) == (10, 30, 10)
    assert acc.accepted_per_position == [6, 3, 1]
    assert acc.rate_per_position == pytest.approx([0.6, 0.3, 0.1])
    assert acc.acceptance_rate == pytest.approx(10 / 30)
    assert acc.mean_accepted_length == pytest.approx(2.0)


def test_acceptance_of_a_run_without_drafts() -> None:
    acc = Acceptance.between({}, {})
    assert acc.accepted_per_position == []
    assert (acc.acceptance_rate, acc.mean_accepted_length) == (0.0, 1.0)


def test_tokens_per_s_is_the_median_pass() -> None:
    timing = Timing(tokens=[100, 100, 90], seconds=[1.0, 0.5, 1.5])  # 100, 200, 60 tokens/s
    assert timing.rates == pytest.approx([100.0, 200.0, 60.0])
    assert timing.tokens_per_s == pytest.approx(100.0)
    assert timing.median_pass == 0
    # an even count: the lower middle pass, so the rate is one a pass had
    even = Timing(tokens=[10, 10, 10, 10], seconds=[1.0, 0.25, 0.5, 2.0])  # 10, 40, 20, 5
    assert even.tokens_per_s == pytest.approx(10.0) and even.median_pass == 0
    one = Timing(tokens=[30], seconds=[3.0])
    assert (one.tokens_per_s, one.median_pass) == (pytest.approx(10.0), 0)


def test_missing_assistant_is_rejected_before_any_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "target"  # only its config.json is looked at
    target.mkdir()
    (target / "config.json").write_text("{}")
    missing = tmp_path / "no-such-assistant"

    def refused(*extra: str) -> str:
        """The command's exit status is 2 and its one-line message on stderr."""
        assert main(["report", "--target", str(target), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gemma4-spec report: ") and err.count("\n") == 1, err
        return err

    assert "no-such-assistant" in refused("--assistant", str(missing))
    # looks like a hub id, but its first folder is here: a local path that is missing
    assert "not a checkpoint folder" in refused("--assistant", "target/no-such-assistant")
    assert "k must be at least 1, not 0" in refused("--assistant", str(target), "--k", "0")
    assert "temperature must be 0" in refused("--assistant", str(target), "--temperature", "-0.5")
    assert "passes must be at least 1, not 0" in refused(
        "--assistant", str(target), "--passes", "0"
    )
    with pytest.raises(SystemExit):  # argparse: not one of the draft methods
        main(["report", "--target", str(target), "--assistant", str(target)]
             + ["--draft-method", "sampled"])  # fmt: skip


def test_bad_input_ends_the_command_without_a_traceback(tmp_path: Path) -> None:
    """What a user sees from the installed command: one line naming the problem, status 2."""
    for command in (
        ["report", "--k", "0"],
        ["report", "--gsm8k", str(tmp_path / "no-gsm8k")],
        ["demo", "--num-prompts", "0"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "gemma4_spec.cli", *command],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(f"gemma4-spec {command[0]}: ")


@pytest.mark.engine
def test_report_on_the_shipped_pair(tmp_path: Path) -> None:
    target, assistant = tiny_gsm8k_pair()
    k, prompts, max_tokens = 3, 2, 24
    proc = subprocess.run(
        [sys.executable, "-m", "gemma4_spec.cli", "report", "--k", str(k)]
        + ["--target", str(target), "--assistant", str(assistant)]
        + ["--num-prompts", str(prompts), "--max-tokens", str(max_tokens), "--out", str(tmp_path)]
        + ["--passes", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "outputs identical with and without speculation: yes" in proc.stdout
    assert "speed-up:" in proc.stdout
    assert proc.stdout.count("the median of 2 passes; passes ") == 2, proc.stdout

    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert (data["k"], data["num_prompts"], data["max_tokens"]) == (k, prompts, max_tokens)
    assert data["outputs_identical"] is True
    assert data["command"][:2] == ["gemma4-spec", "report"]
    assert data["vllm_version"]
    acc = data["acceptance"]
    per_pos = acc["accepted_per_position"]
    assert len(per_pos) == k
    assert sum(per_pos) == acc["num_accepted_tokens"] > 0  # the trained assistant gets some right
    assert per_pos == sorted(per_pos, reverse=True)  # acceptance stops at the first miss
    assert acc["num_draft_tokens"] == k * acc["num_drafts"]
    assert acc["rate_per_position"] == pytest.approx([n / acc["num_drafts"] for n in per_pos])
    assert acc["mean_accepted_length"] == pytest.approx(
        1 + acc["num_accepted_tokens"] / acc["num_drafts"]
    )
    plain, spec = data["plain"], data["speculative"]
    assert len(plain["passes"]) == len(spec["passes"]) == 2
    # greedy: every pass of both engines generates the same tokens
    tokens = {p["tokens"] for run in (plain, spec) for p in run["passes"]}
    assert len(tokens) == 1 and tokens.pop() > 0
    # Each speculative decode step emits its verified token plus the accepted drafts; only the
    # prefill's first token of each prompt comes from a step without drafts. The acceptance
    # counts the first pass.
    first = spec["passes"][0]["tokens"]
    assert first <= acc["num_drafts"] + acc["num_accepted_tokens"] + prompts
    for run in (plain, spec):
        rates = [p["tokens"] / p["seconds"] for p in run["passes"]]
        assert all(p["seconds"] > 0 for p in run["passes"])
        assert run["tokens_per_s"] == pytest.approx(min(rates))  # the lower middle of two
    assert data["speedup"] == pytest.approx(spec["tokens_per_s"] / plain["tokens_per_s"])

    png = tmp_path / PNG_NAME
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] > (100, 100)  # decodes as an image


def test_an_assistant_that_does_not_fit_is_rejected_before_any_engine() -> None:
    target, _ = tiny_gsm8k_pair()
    with pytest.raises(AssistantMismatchError, match="not a Gemma 4 assistant"):
        check_config(ReportConfig(target=str(target), assistant=str(target), k=3))
    assert main(["report", "--target", str(target), "--assistant", str(target)]) == 2


@pytest.mark.engine
def test_sampled_report_with_probabilistic_drafts(tmp_path: Path) -> None:
    # At temperature > 0 the two runs draw different tokens; the report measures acceptance
    # and does not ask for equal outputs (its exit status is 0).
    target, assistant = tiny_gsm8k_pair()
    proc = subprocess.run(
        [sys.executable, "-m", "gemma4_spec.cli", "report", "--k", "2"]
        + ["--target", str(target), "--assistant", str(assistant)]
        + ["--num-prompts", "2", "--max-tokens", "16", "--out", str(tmp_path)]
        + ["--temperature", "1.0", "--draft-method", "probabilistic"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "temperature 1, " in proc.stdout and "probabilistic drafts" in proc.stdout
    assert "not compared (sampled requests)" in proc.stdout
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert (data["temperature"], data["draft_method"]) == (1.0, "probabilistic")
    assert data["outputs_identical"] is None
    acc = data["acceptance"]
    assert acc["num_draft_tokens"] == 2 * acc["num_drafts"] > 0
