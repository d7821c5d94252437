"""A push's progress marks, as its trainer writes them into the group's store (buckets out so far,
or given up / withdrawn), and their reader for processes outside the group: the sidecar's front
end watches a push with it. Imports torch only when it reads."""

from __future__ import annotations


FAILED_MARK = -1
WITHDRAWN_MARK = -2
SENT_MARK = -3  # every byte out and the commit vote passed: the rest of the push is the engines'


class PushProgress:
    """A push's progress as its trainer marks it (WeightSyncGroup.mark_progress), read from
    outside the group by a process that holds the group's connection info."""

    def __init__(self, info: dict, push_id: str, timeout_s: float = 1.0):
        self.info, self.key, self.timeout_s = info, f"mark/progress/{push_id}", timeout_s
        self._prefix = None  # the group's keys in the trainer's store, once connected

    @staticmethod
    def load() -> None:
        """Import what a read needs (torch's TCPStore: seconds on a loaded host), so that a watcher can
        do it before its stall clock runs: the watcher's own start-up is not the trainer's stall."""
        import weight_sync.common.group_store  # noqa: F401

    def read(self) -> int | None:
        """A count that moves while the trainer's push moves (weight_sync/trainer/progress_marks.py;
        FAILED_MARK: given up; WITHDRAWN_MARK: withdrawn before the vote, to be pushed again on a
        fresh layout; SENT_MARK: every byte is out and the commit vote passed); None before the
        transfer began. Raises when
        the trainer's store does not answer within the timeout (a dead or frozen trainer)."""
        from weight_sync.common.group_store import TCPStore, _group_keys, _td  # torch: only once a push runs

        try:
            if self._prefix is None:
                store = TCPStore(self.info["host"], int(self.info["port"]), None, False, _td(self.timeout_s))
                self._prefix = _group_keys(self.info["group_name"], self.info["secret"], store)
            if not self._prefix.check([self.key]):
                return None
            return int(self._prefix.get(self.key))
        except Exception:
            self._prefix = None  # a fresh connection next time
            raise
