"""``benchmarks/pick_split_sizes.py``: the sizes that cost least on the sliding layers at the
batch sizes asked, and the tokens from which they beat vLLM's split kernel at every size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")


def _pick(tmp_path: Path, times: dict[int, tuple[float, float, float]], *args: str) -> str:
    rows = [
        dict(layer=layer, batch=b, context=256, k=2, vllm_2d=30.0, split_3d=v, ours=o, ours_m128=m)
        for b, (o, m, v) in times.items()
        for layer in ("sliding-256", "full-512")
    ]
    run = tmp_path / "chain.json"
    run.write_text(json.dumps(rows))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pick_split_sizes.py"), str(run), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_the_cheapest_sizes_and_where_they_win(tmp_path: Path) -> None:
    # (ours, ours at m128, vLLM's split kernel) us by batch size; 64: no split kernel (NaN),
    # the one-pass kernel's 30 us instead.
    times = {1: (10, 9, 8), 8: (11, 9, 10), 16: (12, 9, 11), 32: (13, 10, 14), 64: (20, 15, NAN)}
    assert _pick(tmp_path, times) == "ours-V2+sizes=m128+large=24"  # wins from B=8 (24 tokens)
    times[8] = (11, 11, 10)  # loses at B=8: from B=16 (48 tokens)
    assert _pick(tmp_path, times) == "ours-V2+sizes=m128+large=48"
    times[16] = (8, 12, 11)  # the defaults cost least at B=16 + 32 now (21 against 22)
    assert _pick(tmp_path, times, "--batch", "16,32") == "ours-V2+large=48"
    times = {b: (30, 30, 1) for b in times}  # never wins: the default's 64 tokens
    assert _pick(tmp_path, times) == "ours-V2+large=64"
