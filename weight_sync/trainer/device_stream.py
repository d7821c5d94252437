"""Where a push runs on a CUDA device, whatever thread sends it (weight_sync/trainer/sender.py)."""

from __future__ import annotations

import contextlib

import torch


class DeviceStream:
    """CUDA's current device and stream are per thread: a sender in `asyncio.to_thread` would
    otherwise pack on cuda:0's default stream. A push runs on a stream of its own (kept between
    pushes), ordered after the work already queued on the device (the optimizer's writes)."""

    def __init__(self):
        self.stream = None

    def on(self, device: torch.device):
        """A context that runs a push on `device` (nothing to do on the CPU)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(device))
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.default_stream(device))  # the optimizer's writes land first
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack
