"""Emulated hosts for real: each host a network namespace with its own stack, joined to one bridge
by a veth pair whose two ends are shaped to the link's rate (tc tbf: the host's upload on its end,
its download on the bridge's). A process started "on" a host runs inside its namespace and
reaches the others only over those links. Used by the tests of several hosts (tests/hosts) and
by `python -m bench.hosts`.

What a bed makes is named after the process that made it (`rb<pid>` the bridge, `rbed-<pid>-<host>`
the namespaces), and removed by `close()`, also when a test fails; `sweep()` removes what a dead
run left. Each bed takes a /24 of 10.213.0.0/16 that no interface or route uses yet, chosen under
a file lock, so two test workers never collide. Needs root (CAP_NET_ADMIN) and `ip` / `tc`:
`unavailable()` says why not, for tests to skip with.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

PREFIX = "rbed-"  # namespaces: rbed-<pid>-<host>
ETC_NETNS = "/etc/netns"  # `ip netns exec NS` mounts /etc/netns/NS/* over /etc/* for what it runs
NET = ipaddress.ip_network("10.213.0.0/16")
_LOCK = "/tmp/rollout-hostbed.lock"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why this machine cannot host a bed (None: it can)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (CAP_NET_ADMIN) to make network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    _ip("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_all_in(ns: str) -> None:
    pids = _ip("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep() -> list[str]:
    """Removes the namespaces and bridges of beds whose process is gone; returns their names."""
    gone = []
    for line in _ip("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if m and not _alive(int(m.group(2))):
            _kill_all_in(m.group(1))
            _ip("ip", "netns", "del", m.group(1), check=False)
            shutil.rmtree(os.path.join(ETC_NETNS, m.group(1)), ignore_errors=True)
            gone.append(m.group(1))
    for line in _ip("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"\d+: (rb(\d+)):", line)
        if m and not _alive(int(m.group(2))):
            _ip("ip", "link", "del", m.group(1), check=False)
            gone.append(m.group(1))
    return gone


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("ip", "-o", "addr", "show", check=False).stdout + _ip("ip", "route", "show", check=False).stdout
    for net in NET.subnets(new_prefix=24):
        if str(net.network_address).rsplit(".", 1)[0] + "." not in used:
            return net
    raise RuntimeError(f"every /24 of {NET} is in use")


class HostBed:
    """Hosts `names` on a bridge, each link shaped to `rate_mbit` in both directions (None: not
    shaped). The bridge holds the first address of the subnet; host k the (k+2)-th."""

    def __init__(self, names: Sequence[str], rate_mbit: float | None = None):
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z][a-z0-9]{0,7}", n) for n in names):
            raise ValueError(f"host names must be distinct, lowercase, at most 8 characters: {list(names)}")
        self.names = list(names)
        self.rate_mbit = rate_mbit
        self.tag = str(os.getpid())
        self.bridge = f"rb{self.tag}"
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []  # namespaces made so far, for close()
        self.addrs: dict[str, str] = {}
        self.subnet: ipaddress.IPv4Network | None = None

    def ns(self, host: str) -> str:
        return f"{PREFIX}{self.tag}-{host}"

    def _veth(self, k: int) -> str:
        return f"rv{self.tag}x{k}"

    def addr(self, host: str) -> str:
        return self.addrs[host]

    def __enter__(self) -> HostBed:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> HostBed:
        sweep()
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the subnet check and the bridge's address, one bed at a time
            self.subnet = _free_subnet()
            hosts = list(self.subnet.hosts())
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "addr", "add", f"{hosts[0]}/24", "dev", self.bridge)
            _ip("ip", "link", "set", self.bridge, "up")
        self.gateway = str(hosts[0])
        for k, name in enumerate(self.names):
            ns, veth, addr = self.ns(name), self._veth(k), str(hosts[k + 1])
            _ip("ip", "netns", "add", ns)
            self.made.append(ns)
            _ip("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("ip", "link", "set", f"{veth}p", "netns", ns)
            _ip("ip", "link", "set", f"{veth}p", "name", "eth0", ns=ns)
            _ip("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _ip("ip", "route", "add", "default", "via", self.gateway, ns=ns)  # Ray finds its address by a route out
            _ip("ip", "link", "set", veth, "master", self.bridge)
            _ip("ip", "link", "set", veth, "up")
            if self.rate_mbit:
                self._shape(veth, None)  # the host's download
                self._shape("eth0", ns)  # its upload
            self.addrs[name] = addr
        self._write_etc()
        log.info("host bed %s: %s on %s%s", self.tag, ", ".join(f"{n}={a}" for n, a in self.addrs.items()),
                 self.subnet, f", links of {self.rate_mbit:g} Mbit/s" if self.rate_mbit else "")
        return self

    def _write_etc(self) -> None:
        """Each host's own /etc/hosts (every host of the bed by name) and resolv.conf (no name
        server: none is reachable from the bed, and a lookup would wait for it). torch's store
        looks its peers' names up: without these each connection took 10 s of DNS timeouts."""
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addrs.items())
        hosts += f"{self.gateway} gateway\n"
        for name in self.names:
            d = os.path.join(ETC_NETNS, self.ns(name))
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write(hosts)
            with open(os.path.join(d, "resolv.conf"), "w") as f:
                f.write("options timeout:1 attempts:1\n")

    def _shape(self, dev: str, ns: str | None, rate_mbit: float | None = None, verb: str = "add") -> None:
        rate_mbit = rate_mbit or self.rate_mbit
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(32 * 1024, int(rate_bytes / 250))  # tbf needs at least rate / HZ of burst
        _ip("tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst),
            "latency", "100ms", ns=ns)

    def rate(self, host: str, rate_mbit: float) -> None:
        """`host`'s link reshaped to `rate_mbit` both ways (the bed's own rate again: pass
        `bed.rate_mbit`): a test that must act while bytes cross it slows it down instead of racing."""
        if not self.rate_mbit:
            raise ValueError("this bed's links are not shaped")
        self._shape(self._veth(self.names.index(host)), None, rate_mbit, "change")
        self._shape("eth0", self.ns(host), rate_mbit, "change")

    def link_bound_s(self, nbytes: int) -> float:
        """The fastest `nbytes` can cross one link of this bed."""
        return nbytes * 8 / (self.rate_mbit * 1e6)

    # -- processes on hosts -------------------------------------------------------------------
    def popen(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """`argv` run on `host` (inside its namespace); it is killed at close()."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kw)
        self.procs.append(proc)
        return proc

    def sidecar(self, host: str, model: str, *args: str, token: str, **kw):
        """A sidecar on `host`, bound to its address (off loopback, so with a token)."""
        from rollout.launcher import LocalSidecar

        side = LocalSidecar(model, "--host", self.addr(host), *args, token=token,
                            prefix=["ip", "netns", "exec", self.ns(host)], **kw)
        self.procs.append(side.proc)
        return side

    def kill_host(self, host: str) -> None:
        """Every process on `host` SIGKILLed at once, as a host that loses power."""
        _kill_all_in(self.ns(host))

    def link(self, host: str, up: bool) -> None:
        """Takes `host`'s link down (nothing crosses it either way) or back up."""
        k = self.names.index(host)
        _ip("ip", "link", "set", self._veth(k), "up" if up else "down")

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for ns in self.made:
            _kill_all_in(ns)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        for ns in self.made:
            while _ip("ip", "netns", "pids", ns, check=False).stdout.split() and time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("ip", "netns", "del", ns, check=False)  # its veth end goes with it, and so its pair
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
        self.made = []
        _ip("ip", "link", "del", self.bridge, check=False)
        try:
            os.rmdir(ETC_NETNS)  # made by the first bed, if no other bed's files are there
        except OSError:
            pass
