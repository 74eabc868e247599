"""free_port for the Python tests, without importing vLLM."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's
    ephemeral range: a port the kernel handed out for port 0 may become the
    source port of the next outgoing connection before the test binds it."""
    lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(200):
        port = random.randrange(20000, max(20001, min(lo, 32768)))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")
