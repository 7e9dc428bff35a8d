"""The verification step's host work, ours against vLLM's: its index arrays
(``spec_decode/verify_metadata.py`` against ``GPUModelRunner._calc_spec_decode_metadata``) and
greedy verification (``ops/greedy_verify.py`` through ``patch/patch_rejection_sampler.py``
against vLLM's ``RejectionSampler.forward``, the in-tree formula, and against the torch
reference that defines the kernel, which reads its inputs back to the host).

The step is bound by the host at small batches, so the host's CPU time per call is the first
figure (the GPU runs behind the calls); GPU time per call is timed apart with CUDA events.
Real vocabulary (262144), bf16 logits, k drafts per request.

    python benchmarks/verify_step.py [--batch 1,8,32] [--k 2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_overhead import gpu_us, host_us  # noqa: E402

from gemma4_spec.ops.greedy_verify import greedy_verify_reference  # noqa: E402
from gemma4_spec.spec_decode.verify_metadata import VerifyMetadataBuilder  # noqa: E402
from gemma4_spec.testing.verify_step import (  # noqa: E402
    greedy_sampling_metadata,
    rejection_samplers,
    spec_decode_metadata,
    vllm_spec_decode_metadata,
)

VOCAB = 262144


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--k", default="2,4")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json", default=None)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args()
    dev = torch.device("cuda")
    sampler, vllm_forward = rejection_samplers(dev)
    input_ids = torch.randint(0, args.vocab, (8192,), dtype=torch.int32, device=dev)
    builder = VerifyMetadataBuilder(dev)
    vllm_calc = vllm_spec_decode_metadata(dev, input_ids, 8192)
    rows = []
    print("host us / GPU us per call")
    print(
        f"{'B':>3} {'k':>2} | index arrays: vLLM    ours        "
        "| greedy verify: vLLM             ours       reference"
    )
    for k in map(int, args.k.split(",")):
        for batch in map(int, args.batch.split(",")):
            drafts = np.full(batch, k, dtype=np.int32)
            cu_scheduled = np.cumsum(np.full(batch, k + 1, dtype=np.int32))
            metadata = spec_decode_metadata([k] * batch, dev)
            logits = torch.randn(batch * (k + 1), args.vocab, device=dev).to(torch.bfloat16)
            best = logits.argmax(-1)
            # Drafts that all match: the longest output (every row's token kept).
            metadata.draft_token_ids = best.view(batch, k + 1)[:, :k].reshape(-1).int()
            sm = greedy_sampling_metadata(batch, dev)
            cu = metadata.cu_num_draft_tokens

            def vllm_verify(m=metadata, lg=logits, s=sm) -> object:
                return vllm_forward(sampler, m, None, lg, s)

            def our_verify(m=metadata, lg=logits, s=sm) -> object:
                return sampler(m, None, lg, s)

            def reference(lg=logits, m=metadata, c=cu, k=k) -> object:
                return greedy_verify_reference(lg.argmax(-1), m.draft_token_ids, c, k)

            assert torch.equal(our_verify().sampled_token_ids, vllm_verify().sampled_token_ids)
            cases: dict[str, Callable[[], object]] = {
                "index_vllm": lambda d=drafts, c=cu_scheduled: vllm_calc(d, c),
                "index_ours": lambda d=drafts, c=cu_scheduled: builder.build(d, c, input_ids),
                "verify_vllm": vllm_verify,
                "verify_ours": our_verify,
                "verify_reference": reference,
            }
            row: dict[str, object] = dict(batch=batch, k=k)
            for name, fn in cases.items():
                reps = args.reps // 10 if name == "verify_reference" else args.reps
                row[name] = (host_us(fn, reps), gpu_us(fn, reps))
            rows.append(row)
            cells = {name: f"{row[name][0]:6.1f}/{row[name][1]:6.1f}" for name in cases}
            print(
                f"{batch:3d} {k:2d} | {cells['index_vllm']} {cells['index_ours']} "
                f"| {cells['verify_vllm']}   {cells['verify_ours']} {cells['verify_reference']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
