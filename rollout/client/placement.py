"""Where a session's calls go when one client drives several sidecars (issue 66 item 1): every call of a
session (an agent's episode, GRPO's n samples of a prompt) goes to the sidecar that served its last one,
whose prefix cache holds the episode so far; a new session goes to the least busy sidecar.

A session moves, once per reason, when its sidecar is gone or paused (not serving), or busier than the
least busy by more than `margin` prompts in flight and more than twice as busy; each move is counted. A
move costs the episode's prefix computed again elsewhere, while a few more rows cost a decode step
little: so a small gap (an episode's tail, where one sidecar's sessions ended sooner) moves nothing,
and new sessions, placed on the least busy, even the load out instead. Ties go to the sidecar with
the fewest sessions pinned, then the emptier KV cache, then the lowest index, so that many new
sessions at once spread instead of all landing on one sidecar (torchtitan #3755: a tie-break that
pinned every session to one generator).
A session ends by `end(session)`, or when it has had no call for `idle_s` seconds: its pin is dropped.

Busy is this client's prompts in flight on each sidecar (sent, not finished), what it knows at once,
plus the others' prompts the sidecar itself reported in flight at its last `observe` (its `load` reply:
other trainers, agents on its HTTP front), with its KV cache's share in use. Pure bookkeeping: no
sockets, no clock but the one given.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable


class Placement:
    def __init__(self, margin: int = 16, idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if margin < 0 or idle_s <= 0:
            raise ValueError(f"margin must be >= 0 and idle_s > 0, got {margin} and {idle_s}")
        self.margin, self.idle_s, self.clock = margin, idle_s, clock
        self.pins: dict[str, tuple[int, float]] = {}  # session -> (sidecar, when its last call was placed)
        self.busy: Counter = Counter()  # sidecar -> this client's prompts in flight
        self.started: Counter = Counter()  # sidecar -> this client's prompts ever sent there (to bound a report)
        self.others: Counter = Counter()  # sidecar -> other clients' prompts in flight, as last reported
        self.kv_used: dict[int, float] = {}  # sidecar -> its KV cache's share in use, as last reported
        self.moves = 0  # sessions moved off the sidecar they were pinned to
        self.sessions = 0  # sessions started

    def place(self, sessions: list[str], serving: list[int]) -> list[int]:
        """The sidecar of each of a call's prompts (one session each; a session named twice goes to one
        sidecar), among the `serving` ones; counted busy until `done`."""
        if not serving:
            raise ValueError("no sidecar serves")
        self._expire()
        now, out = self.clock(), []
        for session in sessions:
            i = self._sidecar(session, serving)
            self.pins[session] = (i, now)
            self.busy[i] += 1
            self.started[i] += 1
            out.append(i)
        return out

    def _sidecar(self, session: str, serving: list[int]) -> int:
        least = min(serving, key=self._order)
        pin = self.pins.get(session)
        if pin is None:
            self.sessions += 1
            return least
        i = pin[0]
        gap = self.load(i) - self.load(least)
        if i in serving and (gap <= self.margin or self.load(i) <= 2 * self.load(least)):
            return i
        self.moves += 1
        return least

    def load(self, i: int) -> int:
        """Prompts in flight on sidecar i: this client's now, the others' as last reported."""
        return self.busy[i] + self.others[i]

    def _order(self, i: int) -> tuple:
        # pinned sessions before KV use: they say where load comes back, and a reported KV share is up to a poll
        # old (a sidecar that just served looks fuller than it is, and sequential sessions bunched up on that)
        return self.load(i), sum(1 for s, _ in self.pins.values() if s == i), self.kv_used.get(i, 0.0), i

    def asked(self) -> dict[int, tuple[int, int]]:
        """What to hand `observe` with the report asked now: this client's prompts in flight and sent so far."""
        return {i: (self.busy[i], n) for i, n in self.started.items()}  # (busy only where something was sent)

    def observe(self, i: int, groups: int, kv_used: float = -1.0, then: tuple[int, int] = (0, 0)) -> None:
        """Sidecar i reported `groups` prompts in flight (every client's) and its KV cache's share in use
        (protocol.LoadReply): what is not this client's counts as the others' until the next report.
        `then`: `asked()[i]` when the report was asked. It was taken between then and now, so it may count
        any of ours in flight then or sent since, even calls that have ended (never taken for others')."""
        busy_then, started_then = then
        ours_at_most = busy_then + self.started[i] - started_then  # never less than ours in flight now
        self.others[i] = max(0, groups - ours_at_most)
        if kv_used >= 0:
            self.kv_used[i] = kv_used

    def least_busy_first(self, serving: list[int]) -> list[int]:
        """The serving sidecars, the least busy first (ties as for new sessions)."""
        return sorted(serving, key=self._order)

    def pick(self, serving: list[int]) -> int:
        """The sidecar for one call of no session: the least busy; counted busy until `done`."""
        if not serving:
            raise ValueError("no sidecar serves")
        i = min(serving, key=self._order)
        self.busy[i] += 1
        self.started[i] += 1
        return i

    def sent(self, i: int, n: int) -> None:
        """n prompts of no session went to sidecar i (a contiguous part of a call): busy there too."""
        self.busy[i] += n
        self.started[i] += n

    def done(self, i: int, n: int = 1) -> None:
        """n prompts placed on sidecar i finished (or failed, or went elsewhere)."""
        self.busy[i] = max(0, self.busy[i] - n)

    def end(self, session: str) -> None:
        self.pins.pop(session, None)

    def _expire(self) -> None:
        cutoff = self.clock() - self.idle_s
        for session in [s for s, (_, when) in self.pins.items() if when < cutoff]:
            del self.pins[session]

    def stats(self) -> dict:
        """Sessions started and pinned now, moves, this client's prompts in flight per sidecar and the
        others' (as last reported), and the sessions pinned per sidecar."""
        return {"sessions": self.sessions, "pinned": len(self.pins), "moves": self.moves,
                "busy": {i: n for i, n in self.busy.items() if n},
                "others": {i: n for i, n in self.others.items() if n},
                "pinned_per_sidecar": dict(Counter(i for i, _ in self.pins.values()))}
