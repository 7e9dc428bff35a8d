"""The README's demo, as a user runs it: default vLLM settings, so the engine core and the
worker are separate processes and the plugin must load (and patch the runner) in each."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_demo_answers_a_gsm8k_question_and_reports_acceptance() -> None:
    command = [sys.executable, "-m", "gemma4_spec.cli", "demo", "--k", "2"]
    command += ["--num-prompts", "2", "--max-tokens", "48"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "GSM8k question: Janet" in out  # the first GSM8k test question
    answer = re.search(r"^answer \(greedy, with speculative decoding\): (.+)$", out, re.M)
    assert answer is not None and answer.group(1).strip(), out
    assert "outputs identical with and without speculation: yes" in out
    rates = re.search(r"^acceptance rate by draft position: 1: ([\d.]+), 2: ([\d.]+)$", out, re.M)
    assert rates is not None, out
    assert float(rates.group(1)) > 0, "the trained assistant had no draft accepted"
    assert re.search(r"^speed-up: [\d.]+x$", out, re.M), out
    # each engine timed over three passes (the default), the median pass's figures shown
    assert out.count("the median of 3 passes; passes ") == 2, out
