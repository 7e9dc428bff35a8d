"""What of the whole-draft-loop graphs (``spec_decode/draft_graphs.py``) can be checked without
a GPU: when they are off, and the padding of a batch's attention metadata. Capture and replay
run in tests/test_gpu_engine.py (CUDA only)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from gemma4_spec.spec_decode.draft_graphs import (
    FULL_DRAFT_GRAPHS_ENV,
    DraftLoopGraphs,
    _pad_common_metadata,
)


def _proposer(device: str = "cpu", dp: int = 1, eager: bool = False) -> SimpleNamespace:
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp),
        model_config=SimpleNamespace(enforce_eager=eager),
    )
    return SimpleNamespace(device=torch.device(device), vllm_config=config)


def test_off_without_cuda() -> None:
    graphs = DraftLoopGraphs(_proposer("cpu"))  # type: ignore[arg-type]
    assert graphs.disabled == "no CUDA"
    assert graphs.draft(4, 2, None) is None  # type: ignore[arg-type]
    assert graphs.captured == []


@pytest.mark.parametrize(
    ("kwargs", "env", "reason"),
    [
        ({"dp": 2}, None, "data parallelism"),
        ({"eager": True}, None, "enforce_eager"),
        ({}, "0", f"{FULL_DRAFT_GRAPHS_ENV}=0"),
    ],
)
def test_off_when_unsupported_or_asked(monkeypatch, kwargs, env, reason) -> None:  # type: ignore[no-untyped-def]
    if env is not None:
        monkeypatch.setenv(FULL_DRAFT_GRAPHS_ENV, env)
    proposer = _proposer("cuda", **kwargs)  # a device object only; nothing runs on it
    assert DraftLoopGraphs(proposer).disabled == reason  # type: ignore[arg-type]


def _metadata(batch: int) -> CommonAttentionMetadata:
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), 9, dtype=torch.int32),
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=9,
        block_table_tensor=torch.zeros(batch, 4, dtype=torch.int32),
        slot_mapping=torch.arange(batch, dtype=torch.int64),
        positions=torch.arange(batch),
        is_prefilling=torch.zeros(batch, dtype=torch.bool),
        encoder_seq_lens_cpu=np.zeros(batch, dtype=np.int32),
    )


def test_padding_replaces_the_batch_and_drops_other_per_request_fields() -> None:
    batch, size = 3, 8
    metadata = _metadata(batch)
    seq_lens = torch.ones(size, dtype=torch.int32)
    padded = _pad_common_metadata(
        metadata,
        batch,
        seq_lens=seq_lens,
        num_reqs=size,
        num_actual_tokens=size,
        query_start_loc=torch.arange(size + 1, dtype=torch.int32),
        positions=torch.zeros(size, dtype=torch.long),
    )
    assert padded.seq_lens is seq_lens and padded.num_reqs == size
    assert padded.positions is not None and padded.positions.shape[0] == size
    # Per-request optional fields sized for the unpadded batch would not match: dropped.
    assert padded.is_prefilling is None and padded.encoder_seq_lens_cpu is None
    # Required fields not replaced stay as they were; the original is untouched.
    assert padded.block_table_tensor is metadata.block_table_tensor
    assert metadata.num_reqs == batch and metadata.is_prefilling is not None
