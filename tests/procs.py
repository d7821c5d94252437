"""Process helpers for tests: which processes are our descendants, signalling a process with all of them, a free
port."""

import os
import socket


def descendants(pid: int | None = None) -> list[int]:
    pid = pid or os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                state, ppid = stat.rsplit(")", 1)[1].split()[:2]
                if state != "Z":
                    parents[int(entry)] = int(ppid)
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def signal_tree(pid: int, sig: int) -> None:
    """`sig` to a process and every process under it (a sidecar and its engines, as to a whole host)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
