"""``benchmarks/e2e_decode.py --table``: the tables of a saved run, on any machine.

The paired table divides each round by the plain run's round of the same turn, so a round in
which the host ran slow for everyone cancels out; the ratio of medians does not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(rounds_plain: list[float], rounds_ours: list[float]) -> dict:
    def figures(rounds: list[float], acceptance: float | None) -> dict:
        ordered = sorted(rounds)
        return {
            "step_ms": ordered[len(ordered) // 2],
            "step_ms_all": rounds,
            "cpu_ms_all": rounds,
            "gc_ms_all": [0.0] * len(rounds),
            "acceptance_rate": acceptance,
        }

    return {
        "results": {
            "plain (V1)": {"1": figures(rounds_plain, None)},
            "ours k=2 (V1)": {"1": figures(rounds_ours, 0.0)},
        }
    }


def test_table_pairs_each_round_with_plain_of_the_same_round(tmp_path: Path) -> None:
    # Round 2 was slow for both; ours costs 1.1x plain in rounds 1 and 2, 1.2x in round 3.
    saved = tmp_path / "e2e.json"
    saved.write_text(json.dumps(_run([2.0, 4.0, 2.5], [2.2, 4.4, 3.0])))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e_decode.py"), "--table", str(saved)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    paired = lines.index(
        "per round, x same-runner plain in the same round: median (lowest - highest)"
    )
    ours_paired = next(line for line in lines[paired:] if line.startswith("ours k=2 (V1)"))
    assert "1.10x (1.10 - 1.20)" in ours_paired
    # The medians of the rounds, divided: 3.0 / 2.5.
    ours_step = next(line for line in lines if line.startswith("ours k=2 (V1)"))
    assert "3.000 1.20x/1.20x a=0.00" in ours_step
    spread = lines.index("per round, ms: fastest - slowest (fastest x same-runner plain's fastest)")
    ours_spread = next(line for line in lines[spread:] if line.startswith("ours k=2 (V1)"))
    assert "2.200 -  4.400 (1.10x)" in ours_spread
