"""Host addresses, without torch: the sidecar checks them before it imports anything heavy."""

from __future__ import annotations

import ipaddress
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
