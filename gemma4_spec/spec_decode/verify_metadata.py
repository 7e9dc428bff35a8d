"""The verification step's index arrays (vLLM's ``SpecDecodeMetadata``), sent to the GPU in one
copy.

Before each verification the V1 runner works out, from every request's number of drafts and
the cumulative number of scheduled tokens: which rows get logits, which of them score drafts
and which give the bonus token, the cumulative counts, and the draft token ids. vLLM's own
``GPUModelRunner._calc_spec_decode_metadata`` sends each of its five index arrays to the GPU by
itself (a pinned copy and a transfer each) and gathers the draft ids in two steps: about
0.25 ms of host time a step on the H200 machine (``benchmarks/e2e_decode.py --scopes``), with
the host bounding the step at small batches.

``VerifyMetadataBuilder.build`` computes the same arrays on the host with numpy, packs them into
one reused pinned buffer, sends that in one transfer into one reused device buffer and gathers
the draft ids in one step. Same values, dtypes and shapes as vLLM's (tested against it).
Reusing the buffers is safe: the runner calls this inside its input-preparation section, which
waits for the previous step's transfers, and every reader of a step's arrays runs on the
runner's stream before the next step's transfer.

``patch/patch_gpu_model_runner.py`` routes the runner here when the drafter is ours;
``GEMMA4_SPEC_VERIFY_METADATA=0`` keeps vLLM's.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

VERIFY_METADATA_ENV = "GEMMA4_SPEC_VERIFY_METADATA"


def verify_metadata_enabled() -> bool:
    return os.environ.get(VERIFY_METADATA_ENV, "1") != "0"


def verify_index_arrays(
    num_draft_tokens: np.ndarray, cu_num_scheduled_tokens: np.ndarray
) -> dict[str, np.ndarray]:
    """The host-side index arrays of one verification step.

    Request i has ``n_i = num_draft_tokens[i]`` drafts; its last ``n_i + 1`` scheduled tokens
    (ending at ``cu_num_scheduled_tokens[i]``) are scored. Logits rows are numbered over the
    scored tokens of all requests in order: request i owns rows
    ``[cu_sampled[i] - n_i - 1, cu_sampled[i])``; the first ``n_i`` score its drafts (the
    target rows), the last gives its bonus token. ``draft_positions`` are the token positions
    (in the step's flattened input ids) holding the drafts: each target row's next token."""
    drafts = num_draft_tokens
    sampled = drafts + 1
    cu_sampled = np.cumsum(sampled, dtype=np.int32)
    cu_drafts = np.cumsum(drafts, dtype=np.int32)
    first_row = cu_sampled - sampled  # each request's first logits row

    # Token position of every logits row: the request's first scored token, plus the offset.
    first_token = cu_num_scheduled_tokens - sampled
    logits_indices = np.repeat(first_token, sampled)
    logits_indices += np.arange(cu_sampled[-1], dtype=np.int32) - np.repeat(first_row, sampled)
    # Logits row of every draft: the request's first row, plus the draft's index.
    target = np.repeat(first_row, drafts)
    target += np.arange(cu_drafts[-1], dtype=np.int32) - np.repeat(cu_drafts - drafts, drafts)
    return {
        "cu_num_draft_tokens": cu_drafts,
        "cu_num_sampled_tokens": cu_sampled,
        "logits_indices": logits_indices,
        "target_logits_indices": target,
        "bonus_logits_indices": cu_sampled - 1,
        "draft_positions": logits_indices[target + 1],
    }


class VerifyMetadataBuilder:
    """Reused host and device buffers for one runner's verification index arrays."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._device = torch.empty(0, dtype=torch.uint8, device=device)
        self.builds = 0

    def _room(self, nbytes: int) -> None:
        if self._host.numel() >= nbytes:
            return
        size = max(nbytes, 2 * self._host.numel(), 4096)
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        self._device = torch.empty(size, dtype=torch.uint8, device=self.device)

    def build(
        self,
        num_draft_tokens: np.ndarray,
        cu_num_scheduled_tokens: np.ndarray,
        input_ids: torch.Tensor,
    ) -> SpecDecodeMetadata:
        """vLLM's ``SpecDecodeMetadata`` for one step; ``input_ids`` are the step's flattened
        input token ids on the device (the runner's ``input_ids.gpu``)."""
        self.builds += 1
        arrays = verify_index_arrays(num_draft_tokens, cu_num_scheduled_tokens)
        # Widest dtypes first, so that every array starts aligned for its own dtype.
        order = sorted(arrays, key=lambda name: -arrays[name].itemsize)
        offsets, end = {}, 0
        for name in order:
            offsets[name] = end
            end += arrays[name].nbytes
        self._room(end)
        host = self._host.numpy()
        for name in order:
            a = arrays[name]
            host[offsets[name] : offsets[name] + a.nbytes].view(a.dtype)[:] = a
        if self.device.type == "cpu":  # no transfer; a fresh tensor, as later steps reuse ours
            packed = self._host[:end].clone()
        else:
            packed = self._device[:end]
            packed.copy_(self._host[:end], non_blocking=True)
        on_device = {
            name: packed[offsets[name] : offsets[name] + arrays[name].nbytes].view(
                _TORCH_DTYPES[arrays[name].dtype.type]
            )
            for name in order
        }
        return SpecDecodeMetadata(
            draft_token_ids=input_ids[on_device["draft_positions"]],
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=on_device["cu_num_draft_tokens"],
            cu_num_sampled_tokens=on_device["cu_num_sampled_tokens"],
            target_logits_indices=on_device["target_logits_indices"],
            bonus_logits_indices=on_device["bonus_logits_indices"],
            logits_indices=on_device["logits_indices"],
        )


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}
