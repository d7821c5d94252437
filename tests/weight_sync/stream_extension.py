"""A WeightSyncExtension whose receive-stream hook records where it is entered (the CPU has no
streams: this shows the overlapped receive runs inside the hook, on its own thread)."""

import contextlib
import threading

from weight_sync.receiver import WeightSyncExtension


class RecordingReceiveStream(WeightSyncExtension):
    def _ws_receive_stream(self):
        log = self.__dict__.setdefault("_stream_log", [])

        @contextlib.contextmanager
        def recorded():
            log.append(("enter", threading.current_thread().name))
            yield
            staged = self._ws().staged
            log.append(("exit", "staging allocated inside" if staged.staging is not None else "no staging"))

        return recorded()

    def receive_stream_log(self) -> list:
        return list(self.__dict__.get("_stream_log", []))
