"""A WeightSyncExtension whose receive-stream hook records where it is entered (the CPU has no
streams: this shows the overlapped receive runs inside the hook, on its own thread)."""

import contextlib
import threading

from weight_sync.engine_side.extension import WeightSyncExtension
from weight_sync.engine_side.overlapped_receive import OverlappedReceive


class RecordingOverlap(OverlappedReceive):
    def __init__(self, receiver, log: list):
        super().__init__(receiver)
        self.log = log

    def receive_stream(self):
        @contextlib.contextmanager
        def recorded():
            self.log.append(("enter", threading.current_thread().name))
            yield
            staged = self.staged
            self.log.append(("exit", "staging allocated inside" if staged.staging is not None else "no staging"))

        return recorded()


class RecordingReceiveStream(WeightSyncExtension):
    def _overlapped(self):
        if "_weight_sync" not in self.__dict__:
            self._weight_sync = RecordingOverlap(self._new_receiver(), self.__dict__.setdefault("_stream_log", []))
        return self._weight_sync

    def receive_stream_log(self) -> list:
        return list(self.__dict__.get("_stream_log", []))
