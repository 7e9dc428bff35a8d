"""A reused pinned host buffer and its device twin: a step's small host arrays sent to the GPU in
one copy (``verify_metadata.py``, ``verify_input_ids.py``).

Reusing both buffers every step is safe where the runner uses them: it fills the host side
inside its input-preparation section, which first waits for the previous step's transfers, and
every reader of a step's device data runs on the runner's stream before the next step's copy.
On the CPU there is no transfer: ``send`` returns a fresh copy, as the next step reuses the
host side.
"""

from __future__ import annotations

import numpy as np
import torch


class TransferBuffer:
    def __init__(self, device: torch.device, dtype: torch.dtype, min_size: int) -> None:
        self.device = device
        self.dtype = dtype
        self.min_size = min_size
        self.host = torch.empty(0, dtype=dtype)
        self.on_device = torch.empty(0, dtype=dtype, device=device)

    def reserve(self, size: int) -> bool:
        """Room for ``size`` elements; True if that replaced the buffers (views of the old ones
        are stale)."""
        if self.host.shape[0] >= size:
            return False
        size = max(size, 2 * self.host.shape[0], self.min_size)
        self.host = torch.empty(size, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self.on_device = torch.empty(size, dtype=self.dtype, device=self.device)
        return True

    def host_numpy(self) -> np.ndarray:
        return self.host.numpy()

    def send(self, size: int) -> torch.Tensor:
        """The first ``size`` host elements, on the device (the device twin's own slice on
        CUDA, a fresh tensor on the CPU)."""
        if self.device.type == "cpu":
            return self.host[:size].clone()
        out = self.on_device[:size]
        out.copy_(self.host[:size], non_blocking=True)
        return out
