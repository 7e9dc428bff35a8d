"""The verification step's host work, ours against vLLM's: its index arrays
(``spec_decode/verify_metadata.py`` against ``GPUModelRunner._calc_spec_decode_metadata``;
"ours" repeats one step, as steady decoding does, so its arrays are reused; "ours, new" alternates
two steps), greedy verification (``ops/greedy_verify.py`` through
``patch/patch_rejection_sampler.py`` against vLLM's ``RejectionSampler.forward``, the in-tree
formula, and against the torch reference that defines the kernel, which reads its inputs back
to the host), and the draft start after it (``spec_decode/draft_start.py`` over
``ops/verify_outcome.py``, against vLLM's ``prepare_next_token_ids_padded`` +
``prepare_inputs_padded`` and against the kernels' torch references).

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
from gemma4_spec.ops.verify_outcome import (  # noqa: E402
    draft_rows_reference,
    next_tokens_reference,
)
from gemma4_spec.spec_decode.draft_start import DraftStart  # noqa: E402
from gemma4_spec.spec_decode.verify_metadata import VerifyMetadataBuilder  # noqa: E402
from gemma4_spec.testing.verify_step import (  # noqa: E402
    draft_start_state,
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
    start = DraftStart(64, dev)
    print("host us / GPU us per call")
    print(
        f"{'B':>3} {'k':>2} | index arrays: vLLM    ours          ours, new   "
        "| greedy verify: vLLM             ours       reference "
        "| draft start: vLLM             ours       reference"
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
            # Two steps that differ (the first request one token longer): never reused.
            both = [cu_scheduled, cu_scheduled + 1]

            def index_new(d=drafts, b=both) -> object:
                b.reverse()
                return builder.build(d, b[0], input_ids)

            vllm_start, our_start, start_reference = _draft_starts(
                start, our_verify().sampled_token_ids, metadata, batch, k, dev
            )
            cases: dict[str, Callable[[], object]] = {
                "index_vllm": lambda d=drafts, c=cu_scheduled: vllm_calc(d, c),
                "index_ours": lambda d=drafts, c=cu_scheduled: builder.build(d, c, input_ids),
                "index_ours_new": index_new,
                "verify_vllm": vllm_verify,
                "verify_ours": our_verify,
                "verify_reference": reference,
                "start_vllm": vllm_start,
                "start_ours": our_start,
                "start_reference": start_reference,
            }
            row: dict[str, object] = dict(batch=batch, k=k)
            for name, fn in cases.items():
                reps = args.reps // 10 if name == "verify_reference" else args.reps
                row[name] = (host_us(fn, reps), gpu_us(fn, reps))
            rows.append(row)
            cells = {name: f"{row[name][0]:6.1f}/{row[name][1]:6.1f}" for name in cases}
            print(
                f"{batch:3d} {k:2d} | {cells['index_vllm']} {cells['index_ours']} "
                f"{cells['index_ours_new']} "
                f"| {cells['verify_vllm']}   {cells['verify_ours']} {cells['verify_reference']} "
                f"| {cells['start_vllm']}   {cells['start_ours']} {cells['start_reference']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def _draft_starts(
    start: DraftStart, sampled: torch.Tensor, metadata: object, batch: int, k: int, dev: object
) -> tuple[Callable[[], object], ...]:
    """(vLLM's two methods, ours, the references) on one verified step of ``batch`` requests
    with ``k`` drafts each, none discarded."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.utils import CpuGpuBuffer

    qsl = torch.arange(0, batch * (k + 1) + 1, k + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), 300, dtype=torch.int32, device=dev)
    tokens = {f"r{i}": [7] * 100 for i in range(batch)}
    requests, state, common = draft_start_state(qsl, seq_lens, tokens, np.full(64, 100), VOCAB)
    discard = torch.zeros(64, dtype=torch.bool, device=dev)

    def backup() -> CpuGpuBuffer:
        return CpuGpuBuffer(64, dtype=torch.int32, device=dev, pin_memory=torch.cuda.is_available())

    theirs = SimpleNamespace(backup_next_token_ids=backup())
    ours_backup = backup()
    base = SpecDecodeBaseProposer

    def vllms() -> object:
        _, kept = base.prepare_next_token_ids_padded(theirs, sampled, requests, state, discard)
        return base.prepare_inputs_padded(theirs, common, metadata, kept)

    def ours() -> object:
        _, kept = start.next_tokens(sampled, requests, state, discard, ours_backup)
        return start.rows(common, metadata.cu_num_draft_tokens, kept)  # type: ignore[attr-defined]

    def reference() -> object:
        _, kept = next_tokens_reference(sampled, discard, ours_backup.gpu, VOCAB)
        return draft_rows_reference(
            metadata.cu_num_draft_tokens,
            kept,
            common.query_start_loc,
            batch,  # type: ignore[attr-defined]
        )

    assert all(torch.equal(a, b) for a, b in zip(ours()[1:], vllms()[1:], strict=True))
    return vllms, ours, reference


if __name__ == "__main__":
    main()
