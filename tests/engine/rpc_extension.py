"""A worker extension used by the tests to exercise collective_rpc (loaded by dotted path)."""

import threading
import time
from concurrent.futures import Future

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

    def later(self, value=None, error: str | None = None) -> Future:
        """A deferred answer: a Future that a thread completes at `release_later` (with `value`,
        or failing: error "refuse" a ValueError, any other a RuntimeError)."""
        fut: Future = Future()
        self.__dict__.setdefault("_later", []).append((fut, value, error))
        return fut

    def release_later(self) -> int:
        """Completes every pending `later` future, from a thread of its own; how many."""
        pending, self._later = self.__dict__.get("_later", []), []

        def complete():
            for fut, value, error in pending:
                if error is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(Refusal(error) if error == "refuse" else RuntimeError(error))

        threading.Thread(target=complete, daemon=True, name="complete-later").start()
        return len(pending)

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

