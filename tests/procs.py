"""Process helpers for tests: which processes are our descendants."""

import os


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
