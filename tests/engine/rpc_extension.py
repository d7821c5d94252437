"""A worker extension used by the tests to exercise collective_rpc (loaded by dotted path)."""

import time

import torch


class RpcTestExtension:
    def add(self, a, b):
        return a + b

    def boom(self):
        raise RuntimeError("boom from the worker")

    def slow(self, seconds):
        time.sleep(seconds)
        return seconds

    def double_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    def scale_weights(self, factor: float) -> bool:
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(factor)
        return True

    def unsendable(self):
        return object()

    def poison_weights(self) -> bool:
        """A NaN in the first weight: every forward's logits become NaN."""
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] = float("nan")
        return True

    def break_forward(self) -> bool:
        """Every later forward raises, as a CUDA error or an OOM would: the engine must die of it."""
        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

        self.runner.forward = broken
        return True

    def refuse(self):
        raise Refusal("nothing changed")

    def mislabelled(self):
        raise ValueErrorLookalike("a failure whose name merely starts like ValueError")


class Refusal(ValueError):
    """A ValueError under another name: the caller must still see a ValueError."""


class ValueErrorLookalike(RuntimeError):
    pass

