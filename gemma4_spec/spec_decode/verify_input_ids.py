"""The verification step's input ids under async scheduling, with one host-to-device copy.

With async scheduling the host schedules step N + 1 before step N's tokens are on the host:
requests carried over from step N find their new token (N's sampled token) and their drafts
only on the GPU, and the runner writes them into the step's flattened input ids there. vLLM's
``GPUModelRunner._prepare_input_ids`` does it with four index lists, each made into a pinned
tensor and sent by itself, on every speculative step (a speculative batch never takes its
one-slice shortcut: each request has drafts after its sampled token). Pinned allocations and
transfers are host time, on a step the host bounds at small batches.

``carried_tokens`` works out, on the host with numpy, where each carried request's tokens go:
its last scheduled token is its last draft, the sampled token sits before its drafts, and the
drafts come from the request's row of step N's drafts. ``VerifyInputIds.write`` sends the four
index arrays in one transfer of one reused pinned buffer (``transfer_buffer.py``), then scatters
as vLLM does. Same result as vLLM's method (tested against it).

The steady state of decoding needs no indices at all: every request keeps its row and has the
same number ``d`` of drafts, so the step's input ids are an ``[R, 1 + d]`` block whose first
column is step N's sampled tokens and whose other columns are step N's drafts, row for row
(``uniform_drafts`` recognises it; ``VerifyInputIds.write_uniform`` makes it two copies, with
no host arrays: ~0.25 ms of host time a step at batch 1 on the H200 machine went into the
scatters and their indices).

``patch/patch_gpu_model_runner.py`` routes the runner here when the drafter is ours and the
step has tokens to carry; ``GEMMA4_SPEC_VERIFY_INPUT_IDS=0`` keeps vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass

import numpy as np
import torch

from gemma4_spec.spec_decode.transfer_buffer import TransferBuffer

VERIFY_INPUT_IDS_ENV = "GEMMA4_SPEC_VERIFY_INPUT_IDS"


@dataclass
class CarriedTokens:
    """Where the previous step's tokens go in this step's flattened input ids."""

    sampled_dst: np.ndarray  # int64, per carried request: position of its sampled token
    sampled_src: np.ndarray  # int64, per carried request: its row in the previous step
    draft_dst: np.ndarray  # int64, per draft: its position
    draft_src: np.ndarray  # int64, per draft: its index in the previous step's drafts, flat
    in_place: bool  # every carried request kept its row, one token each: a plain slice copy

    @property
    def num_carried(self) -> int:
        return self.sampled_dst.shape[0]


def carried_tokens(
    prev_positions: np.ndarray,
    draft_lens: np.ndarray,
    cu_num_tokens: np.ndarray,
    prev_num_drafts: int,
) -> CarriedTokens:
    """``prev_positions[i]``: request i's row in the previous step (negative if new);
    ``draft_lens[i]``: its drafts scheduled now; ``cu_num_tokens``: cumulative scheduled tokens;
    ``prev_num_drafts``: drafts per row in the previous step's draft tensor."""
    carried = np.flatnonzero(prev_positions >= 0)
    drafts = draft_lens[carried].astype(np.int64)
    last = cu_num_tokens[carried].astype(np.int64) - 1  # each carried request's last token
    src = prev_positions[carried].astype(np.int64)
    sampled_dst = last - drafts
    # Draft j of a carried request: at its sampled token's position + 1 + j, from its
    # previous row's slot j.
    j = np.arange(int(drafts.sum()), dtype=np.int64) - np.repeat(drafts.cumsum() - drafts, drafts)
    in_place = (
        carried.size > 0 and bool((src == last).all()) and int(last.max()) == carried.size - 1
    )
    return CarriedTokens(
        sampled_dst=sampled_dst,
        sampled_src=src,
        draft_dst=np.repeat(sampled_dst + 1, drafts) + j,
        draft_src=np.repeat(src * prev_num_drafts, drafts) + j,
        in_place=in_place,
    )


def uniform_drafts(
    prev_positions: np.ndarray,
    req_ids: Sequence[str],
    scheduled_drafts: Mapping[str, Sized],
    total_num_scheduled_tokens: int,
    prev_num_drafts: int,
) -> int | None:
    """``d`` if every request (``req_ids``, in batch order) kept its row from the previous step
    and has ``d > 0`` drafts (``scheduled_drafts``, by request id; at most the previous step's
    per-row count) and ``1 + d`` scheduled tokens; otherwise None. Asked of the scheduler's
    mapping as a whole: no per-request Python loop on the steady path."""
    num_reqs = prev_positions.shape[0]
    if num_reqs == 0 or len(scheduled_drafts) != num_reqs:
        return None
    lens = set(map(len, scheduled_drafts.values()))
    if len(lens) != 1:
        return None
    d = lens.pop()
    if (
        not 0 < d <= prev_num_drafts
        or total_num_scheduled_tokens != num_reqs * (d + 1)
        or scheduled_drafts.keys() != set(req_ids)
        or not (prev_positions == np.arange(num_reqs)).all()
    ):
        return None
    # Every request has at least 1 + d scheduled tokens and they add up to R (1 + d): exactly.
    return d


class VerifyInputIds:
    """Reused host and device buffers for one runner's carried-token indices."""

    def __init__(self, device: torch.device) -> None:
        self._buffer = TransferBuffer(device, torch.int64, min_size=1024)
        self.writes = 0
        self.uniform_writes = 0  # of which, steady-state steps (``write_uniform``)
        self._columns: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def write_uniform(
        self,
        input_ids: object,
        num_reqs: int,
        d: int,
        prev_sampled: torch.Tensor,
        prev_drafts: torch.Tensor | None,
    ) -> bool:
        """The input ids of a step ``uniform_drafts`` accepted (``d >= 1`` drafts per request),
        as two block copies; False (nothing written) if the previous step's tensors do not have
        the rows and columns the block needs."""
        if (
            prev_drafts is None
            or prev_drafts.dim() != 2
            or prev_drafts.shape[0] < num_reqs
            or prev_drafts.shape[1] < d
            or prev_sampled.shape[0] < num_reqs
        ):
            return False
        self.writes += 1
        self.uniform_writes += 1
        gpu: torch.Tensor = input_ids.gpu  # type: ignore[attr-defined]
        key = (gpu.data_ptr(), num_reqs, d)
        columns = self._columns.get(key)
        if columns is None:  # the block's two column views, made once per shape
            block = gpu[: num_reqs * (d + 1)].view(num_reqs, d + 1)
            columns = self._columns[key] = (block[:, 0], block[:, 1:])
        columns[0].copy_(prev_sampled[:num_reqs, 0], non_blocking=True)
        columns[1].copy_(prev_drafts[:num_reqs, :d], non_blocking=True)
        return True

    def _send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays on the device, through one transfer."""
        total = sum(a.shape[0] for a in arrays)
        self._buffer.reserve(total)
        np.concatenate(arrays, out=self._buffer.host_numpy()[:total])
        packed = self._buffer.send(total)
        return list(packed.split([a.shape[0] for a in arrays]))

    def write(
        self,
        input_ids: object,
        carried: CarriedTokens,
        prev_sampled: torch.Tensor,
        prev_drafts: torch.Tensor | None,
        total_num_scheduled_tokens: int,
    ) -> None:
        """This step's input ids into ``input_ids`` (the runner's ``CpuGpuBuffer``; its host
        side holds every token the host knows): the host's tokens first where some are not
        carried, then the carried requests' sampled tokens (``prev_sampled`` ``[R, 1+]``, the
        previous step's) and drafts (``prev_drafts``, the previous step's ``[R, k]``)."""
        self.writes += 1
        num_drafts = carried.draft_dst.shape[0]
        if carried.num_carried < total_num_scheduled_tokens - num_drafts:
            input_ids.copy_to_gpu(total_num_scheduled_tokens)  # type: ignore[attr-defined]
        if carried.num_carried == 0:
            return
        gpu: torch.Tensor = input_ids.gpu  # type: ignore[attr-defined]
        if carried.in_place:
            n = carried.num_carried
            gpu[:n].copy_(prev_sampled[:n, 0], non_blocking=True)
            return
        with_drafts = prev_drafts is not None and num_drafts > 0
        arrays = [carried.sampled_dst, carried.sampled_src]
        if with_drafts:
            arrays += [carried.draft_dst, carried.draft_src]
        sent = self._send(arrays)
        gpu.scatter_(0, sent[0], prev_sampled[sent[1], 0])
        if with_drafts:
            assert prev_drafts is not None
            gpu.scatter_(0, sent[2], prev_drafts.to(torch.int32).flatten()[sent[3]])
