"""A stand-in for Model Runner V2's ``UvaBackedTensor`` (vLLM 0.26): the array's values live on
the host (``np``), and ``copy_to_uva`` writes them into the next of a ring of device-visible
buffers and points ``gpu`` at it. Any one buffer therefore holds the current values only until
the next update; code that kept an earlier ``gpu`` (a CUDA graph's baked pointer) reads stale
values. Tests use it to show that a path reads ``gpu`` when it runs."""

from __future__ import annotations

import torch


class UvaRing:
    def __init__(
        self, values: torch.Tensor, device: str | torch.device = "cpu", buffers: int = 2
    ) -> None:
        self.cpu = values.detach().cpu().clone()
        self.np = self.cpu.numpy()
        self._ring = [torch.full_like(self.cpu, -1, device=device) for _ in range(buffers)]
        self._current = -1
        self.gpu = self.copy_to_uva()

    def copy_to_uva(self) -> torch.Tensor:
        """The host values into the next buffer of the ring, which becomes ``gpu``."""
        self._current = (self._current + 1) % len(self._ring)
        self.gpu = self._ring[self._current]
        self.gpu.copy_(self.cpu)
        return self.gpu
