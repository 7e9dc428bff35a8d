"""From a ``verify_attention.py --chain N --ours ...`` run, the real-work variant to put beside
ours-V2: our kernel at the sizes that spend least on E2B's 28 sliding layers in a step at the
batch sizes asked (``--batch``, at ``--context``), and the query tokens from which that beats
vLLM's split kernel at 16 segments at every batch size measured (``large``, the
``GEMMA4_SPEC_LARGE_VERIFY_TOKENS`` the variant gets; the default's ``LARGE_VERIFY_TOKENS``
where it never does).
Prints ``ours-V2+sizes=<label>+large=<tokens>`` and, on stderr, the figures behind it.

    python benchmarks/pick_split_sizes.py verify_attention.json --batch 16,32 --context 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gemma4_spec.patch.patch_triton_attn import LARGE_VERIFY_TOKENS

sys.path.insert(0, str(Path(__file__).parent))
from verify_attention import split_time  # noqa: E402

SLIDING = "sliding-256"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--batch", default="16,32")
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    rows = [
        r
        for r in json.loads(Path(args.run).read_text())
        if r["layer"] == SLIDING and r["context"] == args.context
    ]
    by_batch = {r["batch"]: r for r in rows}
    wanted = [int(b) for b in args.batch.split(",")]
    labels = ["ours", *(key for key in rows[0] if key.startswith("ours_"))]
    cost = {label: sum(by_batch[b][label] for b in wanted) for label in labels}
    best = min(cost, key=cost.__getitem__)
    for label in sorted(cost, key=cost.__getitem__)[:6]:
        print(f"{label:22s} {cost[label]:8.1f} us at B={wanted}", file=sys.stderr)
    k = rows[0]["k"]
    large = LARGE_VERIFY_TOKENS
    for batch in sorted(by_batch, reverse=True):  # from the largest down, while ours wins
        row = by_batch[batch]
        vllm = split_time(row)
        print(f"B={batch:3d}: {best} {row[best]:6.1f} us, vLLM {vllm:6.1f}", file=sys.stderr)
        if row[best] >= vllm:
            break
        large = min(large, batch * (1 + k))
    sizes = best.removeprefix("ours").removeprefix("_")
    print("ours-V2" + (f"+sizes={sizes}" if sizes else "") + f"+large={large}")


if __name__ == "__main__":
    main()
