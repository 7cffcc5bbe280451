"""Host-to-device staging buffers, shared by the runner's step inputs and the decode masks."""

from __future__ import annotations

import torch


class Staged:
    """A persistent device tensor with a pinned host mirror: the host fills the mirror through
    numpy, and one asynchronous copy uploads all of it (one copy a step instead of one per field)."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device):
        self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self._uploaded = None  # CUDA event after the last upload

    def begin_write(self) -> None:
        """Waits until the last upload has read the mirror (it may still be queued behind a step)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)
        if self.dev.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
