"""``ops/verify_outcome.py`` and ``spec_decode/draft_start.py``: the references against a
hand-worked step, the Triton kernels against the references (CUDA, or Triton's interpreter on
CPU), and ``DraftStart`` against vLLM's own ``prepare_next_token_ids_padded`` /
``prepare_inputs_padded`` on random verified steps (on CUDA tensors where there is a GPU: vLLM's
CUDA build runs its kernels on what it is given)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.verify_outcome import (
    draft_rows,
    draft_rows_reference,
    next_tokens,
    next_tokens_reference,
)
from gemma4_spec.testing.verify_step import draft_start_state, use_platform_kernels

VOCAB = 100
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_references_hand_worked() -> None:
    # Request 0 kept 2 of 3 (one rejected); 1 kept all 3; 2 is discarded (a partial prefill);
    # 3 had no drafts (one token); 4 has an out-of-vocabulary id after its real one.
    sampled = torch.tensor(
        [[5, 6, -1], [7, 8, 9], [4, -1, -1], [3, -1, -1], [2, 150, -1]], dtype=torch.int32
    )
    discard = torch.tensor([False, False, True, False, False])
    backup = _i32(50, 51, 52, 53, 54)
    nxt, kept = next_tokens_reference(sampled, discard, backup, VOCAB)
    assert nxt.tolist() == [6, 9, 52, 3, 2]
    assert kept.tolist() == [2, 3, 0, 1, 1]
    assert nxt.dtype == kept.dtype == torch.int32

    cu_drafts = _i32(2, 4, 4, 4, 5)  # 2, 2, 0, 0, 1 drafts
    qsl = _i32(0, 3, 6, 16, 17, 19)  # request 2 scheduled a 10-token chunk
    row, rejected = draft_rows_reference(cu_drafts, kept, qsl, 5)
    assert rejected.tolist() == [1, 0, 0, 0, 1]
    assert row.tolist() == [1, 5, 15, 16, 17]


def _random_outcome(gen: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    b = int(torch.randint(1, 80, (), generator=gen))
    t = int(torch.randint(1, 6, (), generator=gen))
    sampled = torch.randint(0, VOCAB + 5, (b, t), generator=gen, dtype=torch.int32)
    cut = torch.randint(0, t + 1, (b, 1), generator=gen)  # rejected from slot `cut` on
    sampled[torch.arange(t).expand(b, t) >= cut] = -1
    discard = torch.rand(b, generator=gen) < 0.1
    backup = torch.randint(0, VOCAB, (b,), generator=gen, dtype=torch.int32)
    drafts = torch.randint(0, t, (b,), generator=gen)
    cu = torch.cumsum(drafts, 0).to(torch.int32)
    scheduled = drafts + 1 + torch.randint(0, 4, (b,), generator=gen) * (drafts == 0)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(scheduled, 0)]).int()
    return tuple(x.to(device) for x in (sampled, discard, backup, cu, qsl))


def _check_kernels_against_references(device: str) -> None:
    assert triton_usable(torch.device(device)), "no kernel would run: reference against itself"
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        sampled, discard, backup, cu, qsl = _random_outcome(gen, device)
        b = sampled.shape[0]
        outs = [torch.full((b + 3,), -9, dtype=torch.int32, device=device) for _ in range(4)]
        if b % 3 == 0:  # rows further apart than their slots (a slice of a wider tensor)
            wide = torch.full((b, sampled.shape[1] + 2), 7, dtype=sampled.dtype, device=device)
            wide[:, : sampled.shape[1]] = sampled
            sampled = wide[:, : sampled.shape[1]]
        elif b % 3 == 1:  # slots not one element apart
            sampled = sampled.t().contiguous().t()
        next_tokens(sampled, discard, backup, VOCAB, outs[0], outs[1])
        want = next_tokens_reference(sampled, discard, backup, VOCAB)
        assert torch.equal(outs[0][:b].cpu(), want[0].cpu())
        assert torch.equal(outs[1][:b].cpu(), want[1].cpu())
        assert (outs[0][b:] == -9).all()  # nothing past the batch
        draft_rows(cu, outs[1], qsl, b, outs[2], outs[3])
        want = draft_rows_reference(cu, outs[1], qsl, b)
        assert torch.equal(outs[2][:b].cpu(), want[0].cpu())
        assert torch.equal(outs[3][:b].cpu(), want[1].cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_references_cuda() -> None:
    _check_kernels_against_references("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_kernels_match_references_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_verify_outcome", "_check_kernels_against_references")


# --- DraftStart against vLLM's base-class methods ---------------------------------------------


def _step(gen: torch.Generator, max_batch: int):  # type: ignore[no-untyped-def]
    """What both methods read: the runner's requests and batch, and the step's tensors."""
    sampled, discard, _, cu, qsl = _random_outcome(gen, DEVICE)
    b = sampled.shape[0]
    tokens = {f"r{i}": torch.randint(0, VOCAB, (40,), generator=gen).tolist() for i in range(b)}
    seq_lens = torch.randint(1, 500, (b,), generator=gen, dtype=torch.int32).to(DEVICE)
    requests, batch, common = draft_start_state(
        qsl, seq_lens, tokens, np.random.default_rng(b).integers(1, 40, max_batch), VOCAB
    )
    return sampled, requests, batch, discard, SimpleNamespace(cu_num_draft_tokens=cu), common


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return type(a) is type(b) and a == b


def test_draft_start_matches_vllm() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.utils import CpuGpuBuffer

    from gemma4_spec.spec_decode.draft_start import DraftStart

    use_platform_kernels()
    max_batch = 96
    device = torch.device(DEVICE)

    def backup() -> CpuGpuBuffer:
        return CpuGpuBuffer(max_batch, dtype=torch.int32, device=device, pin_memory=False)

    vllms = SimpleNamespace(backup_next_token_ids=backup())
    ours = DraftStart(max_batch, device)
    ours_backup = backup()
    gen = torch.Generator().manual_seed(3)
    for _ in range(25):
        sampled, requests, batch, discard, spec, common = _step(gen, max_batch)
        want_next, want_kept = SpecDecodeBaseProposer.prepare_next_token_ids_padded(
            vllms, sampled, requests, batch, discard
        )
        got_next, got_kept = ours.next_tokens(sampled, requests, batch, discard, ours_backup)
        assert _same(got_next, want_next) and _same(got_kept, want_kept)
        want = SpecDecodeBaseProposer.prepare_inputs_padded(vllms, common, spec, want_kept)
        got = ours.rows(common, spec.cu_num_draft_tokens, got_kept)
        assert _same(got[1], want[1]) and _same(got[2], want[2])
        for field in dataclasses.fields(want[0]):
            name = field.name
            assert _same(getattr(got[0], name), getattr(want[0], name)), name
    assert ours.calls == 25
