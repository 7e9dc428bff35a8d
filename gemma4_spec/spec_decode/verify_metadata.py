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
one reused pinned buffer, sends that in one transfer into one reused device buffer
(``transfer_buffer.py``, which says why reuse is safe) and gathers the draft ids in one step.
Same values, dtypes and shapes as vLLM's (tested against it). A step with the same drafts per
request and the same scheduled-token counts as the step before (the steady state of decoding)
has the same arrays: they are still in the device buffer, and only the draft ids are gathered.

``patch/patch_gpu_model_runner.py`` routes the runner here when the drafter is ours;
``GEMMA4_SPEC_VERIFY_METADATA=0`` keeps vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from gemma4_spec.spec_decode.transfer_buffer import TransferBuffer

VERIFY_METADATA_ENV = "GEMMA4_SPEC_VERIFY_METADATA"


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
    cu_sampled = sampled.cumsum(dtype=np.int32)
    cu_drafts = drafts.cumsum(dtype=np.int32)
    first_row = cu_sampled - sampled  # each request's first logits row

    # Token position of logits row j of request i: its first scored token plus j minus the
    # request's first row, i.e. a per-request shift plus j.
    logits_indices = (cu_num_scheduled_tokens - sampled - first_row).repeat(sampled)
    logits_indices += np.arange(cu_sampled[-1], dtype=np.int32)
    # Logits row of draft d (numbered over all drafts) of request i: its first row plus d
    # minus the drafts before it, i.e. d + i (each earlier request has one row more than
    # drafts: its bonus row).
    target = np.arange(len(drafts), dtype=np.int32).repeat(drafts)
    target += np.arange(cu_drafts[-1], dtype=np.int32)
    return {
        "cu_num_draft_tokens": cu_drafts,
        "cu_num_sampled_tokens": cu_sampled,
        "logits_indices": logits_indices,
        "target_logits_indices": target,
        "bonus_logits_indices": cu_sampled - 1,
        "draft_positions": logits_indices[target + 1],
    }


@dataclass
class _Layout:
    """Where each array sits in the packed buffers, for one shape of step."""

    nbytes: int
    spans: dict[str, tuple[int, int, np.dtype]]  # name -> (byte offset, bytes, dtype)
    host: dict[str, np.ndarray]  # views of the pinned host buffer
    device: dict[str, torch.Tensor]  # views of the device buffer (empty on CPU)


class VerifyMetadataBuilder:
    """Reused host and device buffers for one runner's verification index arrays."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer = TransferBuffer(device, torch.uint8, min_size=4096)
        # Per step shape (array lengths and dtypes): the layout, with its views made once.
        self._layouts: dict[tuple[object, ...], _Layout] = {}
        self.builds = 0
        self.reuses = 0  # builds that found the previous step's arrays still valid
        # The previous build's inputs (as bytes) and its arrays on the device.
        self._last_key: bytes | None = None
        self._last: dict[str, torch.Tensor] = {}

    def _layout(self, arrays: dict[str, np.ndarray]) -> _Layout:
        key = tuple((a.shape[0], a.dtype.char) for a in arrays.values())
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        # Widest dtypes first, so that every array starts aligned for its own dtype.
        spans, end = {}, 0
        for name in sorted(arrays, key=lambda name: -arrays[name].itemsize):
            spans[name] = (end, arrays[name].nbytes, arrays[name].dtype)
            end += arrays[name].nbytes
        if self._buffer.reserve(end):  # new buffers: the views of the old ones go with them
            self._layouts.clear()
        host, device = self._buffer.host_numpy(), self._buffer.on_device
        layout = _Layout(
            nbytes=end,
            spans=spans,
            host={n: host[o : o + b].view(t) for n, (o, b, t) in spans.items()},
            device={}
            if self.device.type == "cpu"
            else {n: _typed(device, o, b, t) for n, (o, b, t) in spans.items()},
        )
        self._layouts[key] = layout
        return layout

    def build(
        self,
        num_draft_tokens: np.ndarray,
        cu_num_scheduled_tokens: np.ndarray,
        input_ids: torch.Tensor,
    ) -> SpecDecodeMetadata:
        """vLLM's ``SpecDecodeMetadata`` for one step; ``input_ids`` are the step's flattened
        input token ids on the device (the runner's ``input_ids.gpu``)."""
        self.builds += 1
        key = (
            num_draft_tokens.dtype.str.encode()
            + num_draft_tokens.tobytes()
            + cu_num_scheduled_tokens.dtype.str.encode()
            + cu_num_scheduled_tokens.tobytes()
        )
        if key == self._last_key:
            self.reuses += 1
            on_device = self._last
        else:
            arrays = verify_index_arrays(num_draft_tokens, cu_num_scheduled_tokens)
            layout = self._layout(arrays)
            for name, view in layout.host.items():
                view[:] = arrays[name]
            packed = self._buffer.send(layout.nbytes)
            # On CUDA the layout's views are views of ``packed``; on the CPU it is new.
            on_device = layout.device or {
                n: _typed(packed, o, b, t) for n, (o, b, t) in layout.spans.items()
            }
            self._last_key, self._last = key, on_device
        return SpecDecodeMetadata(
            draft_token_ids=input_ids[on_device["draft_positions"]],
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=on_device["cu_num_draft_tokens"],
            cu_num_sampled_tokens=on_device["cu_num_sampled_tokens"],
            target_logits_indices=on_device["target_logits_indices"],
            bonus_logits_indices=on_device["bonus_logits_indices"],
            logits_indices=on_device["logits_indices"],
        )


def _typed(buffer: torch.Tensor, offset: int, nbytes: int, dtype: np.dtype) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of a uint8 tensor, as ``dtype``."""
    return buffer[offset : offset + nbytes].view(_TORCH_DTYPES[dtype.type])


_TORCH_DTYPES = {np.int32: torch.int32, np.int64: torch.int64}
