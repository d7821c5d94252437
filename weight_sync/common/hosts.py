"""Host addresses, without torch: the sidecar checks them before it imports anything heavy."""

from __future__ import annotations

import ipaddress
import os
import socket


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address_towards(host: str) -> str:
    """This machine's address that packets to `host` leave from: the kernel's own route choice
    (connecting a UDP socket picks the route and sends nothing). Raises OSError when no route
    reaches `host`."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def advertised_address(host: str) -> str:
    """This rank's address as its peers see it: the one it reaches the trainer (`host`) from."""
    return "127.0.0.1" if is_loopback(host) else local_address_towards(host)


def gloo_device(gloo, host: str):
    """The device this rank's gloo pairs bind to, whose address it advertises to its peers: the
    interface GLOO_SOCKET_IFNAME names, else this machine's address on the route to `host` (the
    trainer's). Not gloo's default device: that binds to whatever the hostname resolves to,
    127.0.x.1 on many hosts files and containers, which no peer on another host can reach."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        if ifname.startswith("lo") and not is_loopback(host):
            from weight_sync.common.votes import WeightSyncError

            raise WeightSyncError(f"GLOO_SOCKET_IFNAME={ifname} would advertise a loopback address to peers that "
                                  f"reach the trainer at {host}, on other hosts: name the interface that reaches "
                                  f"{host}, or unset it (each rank then binds to its address on the route to {host})")
        return gloo.create_device(interface=ifname)
    return gloo.create_device(hostname=advertised_address(host))
