"""The README's demo, as a user runs it: default vLLM settings, so the engine core and the
worker are separate processes and the plugin must load (and patch the runner) in each."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_demo_outputs_match_and_report_counters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "gemma4_spec.cli", "demo", "--workdir", str(tmp_path), "--k", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "outputs identical with and without speculation: yes" in out
    assert "vllm:spec_decode_num_draft_tokens" in out
    assert "acceptance by draft position: 1:" in out
