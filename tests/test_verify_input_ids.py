"""``spec_decode.verify_input_ids``: a hand-worked step, and the patched
``GPUModelRunner._prepare_input_ids`` against vLLM's own on random async-scheduling steps
(requests carried over, reordered, new, with and without drafts), on the CPU and on CUDA where
there is one."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gemma4_spec.spec_decode.verify_input_ids import VerifyInputIds, carried_tokens

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_hand_worked_step() -> None:
    # Now: request 0 is new (3 prompt tokens); request 1 was row 1 and has 2 drafts; request 2
    # was row 0 and has 1 draft. Previous step's drafts: 2 per row.
    got = carried_tokens(
        prev_positions=np.array([-1, 1, 0]),
        draft_lens=np.array([0, 2, 1]),
        cu_num_tokens=np.array([3, 6, 8]),
        prev_num_drafts=2,
    )
    assert got.sampled_dst.tolist() == [3, 6]  # tokens 3 and 6 are the sampled ones
    assert got.sampled_src.tolist() == [1, 0]
    assert got.draft_dst.tolist() == [4, 5, 7]
    assert got.draft_src.tolist() == [2, 3, 0]  # row 1's two drafts, row 0's first
    assert not got.in_place


def test_in_place_needs_the_carried_rows_together() -> None:
    # One token each, rows kept: a slice copy of the previous sampled tokens...
    kept = carried_tokens(np.array([0, 1, 2]), np.zeros(3), np.array([1, 2, 3]), 2)
    assert kept.in_place
    # ...but not with a new request in a freed row between carried ones: row 1's token is its
    # prompt's, not the previous step's row 1.
    gap = carried_tokens(np.array([0, -1, 2]), np.zeros(3), np.array([1, 2, 3]), 2)
    assert gap.sampled_dst.tolist() == [0, 2] and not gap.in_place


def _runner(device: str, rng: np.random.Generator, writer: VerifyInputIds | None):  # type: ignore[no-untyped-def]
    """A random async step: what vLLM's ``_prepare_input_ids`` reads of its runner."""
    from vllm.v1.utils import CpuGpuBuffer

    prev_reqs = int(rng.integers(1, 12))
    k_prev = int(rng.integers(1, 4))
    num_reqs = int(rng.integers(1, 14))
    carried_from = rng.permutation(prev_reqs)  # current request -> previous row, or new
    prev_positions = np.array(
        [carried_from[i] if i < prev_reqs and rng.random() < 0.8 else -1 for i in range(num_reqs)]
    )
    if rng.random() < 0.2:  # sometimes the unchanged batch of plain decoding
        num_reqs = prev_reqs
        prev_positions = np.arange(prev_reqs)
    drafts = np.where(prev_positions >= 0, rng.integers(0, k_prev + 1, num_reqs), 0)
    if rng.random() < 0.2:
        drafts[:] = 0
    if rng.random() < 0.3:  # the steady state of speculative decoding: d drafts each
        num_reqs = prev_reqs
        prev_positions = np.arange(prev_reqs)
        drafts = np.full(num_reqs, int(rng.integers(0, k_prev + 1)))
    new_lens = rng.integers(1, 20, num_reqs)
    if prev_reqs > 2 and rng.random() < 0.15:  # rows kept, one token each, a new one between
        num_reqs = prev_reqs
        prev_positions = np.arange(prev_reqs)
        prev_positions[int(rng.integers(0, prev_reqs - 1))] = -1
        drafts = np.zeros(num_reqs, dtype=np.int64)
        new_lens = np.ones(num_reqs, dtype=np.int64)
    scheduled = np.where(prev_positions >= 0, drafts + 1, new_lens)
    cu = np.cumsum(scheduled)
    input_ids = CpuGpuBuffer(512, dtype=torch.int32, device=torch.device(device), pin_memory=False)
    input_ids.np[: cu[-1]] = rng.integers(0, 1000, cu[-1])  # the host's view of the step
    req_ids = [f"r{i}" for i in range(num_reqs)]
    prev_positions_buf = SimpleNamespace(np=np.full(64, -7, dtype=np.int64))
    prev_positions_buf.np[:num_reqs] = prev_positions
    runner = SimpleNamespace(
        device=torch.device(device),
        input_ids=input_ids,
        prev_positions=prev_positions_buf,
        prev_num_spec_tokens=k_prev,
        enable_prompt_embeds=False,
        _pp_recv_work=None,
        _draft_token_ids=torch.tensor(
            rng.integers(2000, 3000, (prev_reqs, k_prev)), dtype=torch.int64, device=device
        ),
        input_batch=SimpleNamespace(
            req_ids=req_ids,
            prev_sampled_token_ids=torch.tensor(
                rng.integers(5000, 6000, (prev_reqs, 1)), dtype=torch.int32, device=device
            ),
        ),
        drafter=SimpleNamespace(verify_input_ids=writer),
    )
    output = SimpleNamespace(
        scheduled_spec_decode_tokens={
            req_ids[i]: [0] * int(drafts[i]) for i in range(num_reqs) if drafts[i]
        }
    )
    return runner, output, num_reqs, int(cu[-1]), cu


@pytest.mark.parametrize("device", DEVICES)
def test_matches_vllm(device: str) -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    from gemma4_spec.patch import patch_gpu_model_runner

    patch_gpu_model_runner.apply(runner_module)
    ours = runner_module.GPUModelRunner._prepare_input_ids
    vllms = ours.__wrapped__
    writer = VerifyInputIds(torch.device(device))
    for seed in range(80):
        rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
        a = _runner(device, rng_a, writer)
        b = _runner(device, rng_b, None)
        ours(a[0], *a[1:])
        vllms(b[0], *b[1:])
        total = a[3]
        assert torch.equal(a[0].input_ids.gpu[:total], b[0].input_ids.gpu[:total]), seed
    assert writer.writes == 80
    assert 10 < writer.uniform_writes < 70  # both ways were taken


def test_uniform_drafts() -> None:
    from gemma4_spec.spec_decode.verify_input_ids import uniform_drafts

    rows, ids = np.arange(3), ["a", "b", "c"]

    def drafts(*lens: int) -> dict[str, list[int]]:
        return {r: [0] * n for r, n in zip(ids, lens, strict=True) if n}

    assert uniform_drafts(rows, ids, drafts(2, 2, 2), 9, 2) == 2
    assert uniform_drafts(rows, ids, drafts(1, 1, 1), 6, 2) == 1  # fewer than last time
    assert uniform_drafts(rows, ids, drafts(0, 0, 0), 3, 2) is None  # vLLM's own shortcut
    assert uniform_drafts(rows, ids, drafts(2, 2, 2), 9, 1) is None  # more than last time
    assert uniform_drafts(rows, ids, drafts(2, 1, 2), 8, 2) is None
    assert uniform_drafts(rows, ids, drafts(2, 2, 0), 7, 2) is None  # one without drafts
    assert uniform_drafts(np.array([1, 0, 2]), ids, drafts(2, 2, 2), 9, 2) is None  # reordered
    assert uniform_drafts(np.array([0, 1, -1]), ids, drafts(2, 2, 2), 9, 2) is None  # a new one
    assert uniform_drafts(rows, ids, drafts(2, 2, 2), 10, 2) is None  # a longer request
    other = {"a": [0, 0], "b": [0, 0], "x": [0, 0]}  # an id not in the batch
    assert uniform_drafts(rows, ids, other, 9, 2) is None


def test_falls_back_to_vllm_without_carried_tokens() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    from gemma4_spec.patch import patch_gpu_model_runner

    patch_gpu_model_runner.apply(runner_module)
    writer = VerifyInputIds(torch.device("cpu"))
    runner, output, num_reqs, total, cu = _runner("cpu", np.random.default_rng(0), writer)
    runner.input_batch.prev_sampled_token_ids = None  # synchronous scheduling
    runner_module.GPUModelRunner._prepare_input_ids(runner, output, num_reqs, total, cu)
    assert writer.writes == 0
    assert torch.equal(runner.input_ids.gpu[:total], runner.input_ids.cpu[:total])
