"""``spec_decode.verify_metadata``: the verification index arrays against a hand-worked step and
against vLLM's own ``GPUModelRunner._calc_spec_decode_metadata`` (values, dtypes, shapes), on
the CPU and, where there is one, on CUDA through the pinned transfer; and the runner patch that
routes to it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gemma4_spec.spec_decode.verify_metadata import VerifyMetadataBuilder, verify_index_arrays
from gemma4_spec.testing.verify_step import runner_state, vllm_spec_decode_metadata

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FIELDS = (
    "draft_token_ids",
    "cu_num_draft_tokens",
    "cu_num_sampled_tokens",
    "target_logits_indices",
    "bonus_logits_indices",
    "logits_indices",
)


def test_hand_worked_step() -> None:
    # Request 0: 3 drafts in a 4-token decode; request 1: a 100-token prefill chunk, no drafts;
    # request 2: 2 drafts.
    got = verify_index_arrays(
        np.array([3, 0, 2], dtype=np.int32), np.array([4, 104, 107], dtype=np.int32)
    )
    assert got["cu_num_draft_tokens"].tolist() == [3, 3, 5]
    assert got["cu_num_sampled_tokens"].tolist() == [4, 5, 8]
    assert got["logits_indices"].tolist() == [0, 1, 2, 3, 103, 104, 105, 106]
    assert got["target_logits_indices"].tolist() == [0, 1, 2, 5, 6]
    assert got["bonus_logits_indices"].tolist() == [3, 4, 7]
    assert got["draft_positions"].tolist() == [1, 2, 3, 105, 106]


def _random_step(rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
    drafts = rng.integers(0, 5, batch).astype(np.int32)
    drafts[rng.integers(0, batch)] = max(1, drafts.max())  # at least one request drafted
    prefill = rng.integers(0, 60, batch) * (drafts == 0)  # undrafted ones may be prefilling
    scheduled = (drafts + 1 + prefill).astype(np.int32)
    # As the runner makes it: a cumulative sum of int32 counts, int64 (numpy's default).
    return drafts, np.cumsum(scheduled)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_vllm(device: str) -> None:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    rng = np.random.default_rng(0)
    input_ids = torch.randint(0, 1000, (4096,), dtype=torch.int32, device=device)
    vllm_calc = vllm_spec_decode_metadata(device, input_ids, 4096)
    builder = VerifyMetadataBuilder(torch.device(device))
    kept = []
    drafts, cu_scheduled = _random_step(rng, 1)
    for step in range(60):
        if step and rng.random() < 0.3:  # the step before again (steady decoding), new tokens
            drafts, cu_scheduled = drafts.copy(), cu_scheduled.copy()
            input_ids.random_(0, 1000)
        else:
            drafts, cu_scheduled = _random_step(rng, int(rng.integers(1, 40)))
            if step % 2:  # the int32 cumulative counts some callers pass
                cu_scheduled = cu_scheduled.astype(np.int32)
        want = vllm_calc(drafts, cu_scheduled)
        got = builder.build(drafts, cu_scheduled, input_ids)
        assert isinstance(got, SpecDecodeMetadata)
        assert got.num_draft_tokens == want.num_draft_tokens
        assert got.max_spec_len == want.max_spec_len
        for field in FIELDS:
            g, w = getattr(got, field), getattr(want, field)
            assert g.dtype == w.dtype and g.device == w.device, field
            assert torch.equal(g, w), field
        kept.append((got, want))
    assert 5 < builder.reuses < 30
    if device == "cpu":  # CPU steps get tensors of their own (on CUDA, stream order protects)
        got, want = kept[-2]
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize("device", DEVICES)
def test_steps_that_look_alike_and_a_grown_buffer_match_vllm(device: str) -> None:
    """Consecutive steps that share drafts or counts but not both (a decoding request beside a
    prefill's last, shorter chunk) are built anew; a batch too large for the transfer buffer
    replaces it, and the small shape after it is laid out again in the new one."""
    input_ids = torch.randint(0, 1000, (4096,), dtype=torch.int32, device=device)
    vllm_calc = vllm_spec_decode_metadata(device, input_ids, 4096)
    builder = VerifyMetadataBuilder(torch.device(device))
    big = (np.full(256, 3, dtype=np.int32), np.arange(1, 257) * 4)  # 256 requests at k=3
    steps = [
        (np.array([3, 0], dtype=np.int32), np.array([4, 68])),
        (np.array([3, 0], dtype=np.int32), np.array([4, 34])),  # same drafts, other counts
        (np.array([3, 0], dtype=np.int32), np.array([4, 10])),
        (np.array([0, 5], dtype=np.int32), np.array([4, 10])),  # same counts, other drafts
        big,
        (np.array([0, 5], dtype=np.int32), np.array([4, 10])),  # the small shape again
    ]
    for i, (drafts, cu_scheduled) in enumerate(steps):
        input_ids.random_(0, 1000)
        want = vllm_calc(drafts, cu_scheduled)
        got = builder.build(drafts, cu_scheduled, input_ids)
        assert got.num_draft_tokens == want.num_draft_tokens, i
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), (i, field)
    assert builder.reuses == 0


def test_runner_routes_to_our_builder_only_for_our_drafter() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    from gemma4_spec.patch import patch_gpu_model_runner

    patch_gpu_model_runner.apply(runner_module)  # as the plugin does
    patch_gpu_model_runner.apply(runner_module)  # a second time changes nothing
    calc = runner_module.GPUModelRunner._calc_spec_decode_metadata
    input_ids = torch.arange(100, 200, dtype=torch.int32)
    drafts, cu = np.array([2, 1], dtype=np.int32), np.array([3, 5])

    class Recording(VerifyMetadataBuilder):
        calls = 0

        def build(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            Recording.calls += 1
            return super().build(*args, **kwargs)

    ours = runner_state("cpu", input_ids, 64)
    ours.drafter = SimpleNamespace(verify_metadata=Recording(torch.device("cpu")))
    other = runner_state("cpu", input_ids, 64)
    other.drafter = SimpleNamespace()  # e.g. an EAGLE proposer: vLLM's method
    got, want = calc(ours, drafts, cu), calc(other, drafts, cu)
    assert Recording.calls == 1
    assert not hasattr(calc.__wrapped__, "__wrapped__")  # wrapped once, around vLLM's own
    assert got.draft_token_ids.tolist() == want.draft_token_ids.tolist() == [101, 102, 104]
