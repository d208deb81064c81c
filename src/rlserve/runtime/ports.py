"""Ports picked here and bound later by someone else: a child server, a TCPStore, vllm-router, Mooncake.

The usual trick, binding port 0 and reading the kernel's choice, returns a port from the kernel's ephemeral range,
which it goes on handing to every later bind(0) and to every outgoing connection. Between the pick and the
child's own bind, any socket on the machine can take that port (seen: a TCPStore failing with EADDRINUSE in a
busy test run, its port handed meanwhile to another process's store). So ports are picked just below that range,
where the kernel never allocates on its own; at random, so processes picking at once rarely meet; never twice in
one process; and each checked free by binding it."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

POOL_SIZE = 10_000  # ports under the ephemeral range to pick from
TRIES = 200
_rng = random.SystemRandom()  # forked children and tests that seed `random` must not pick the same sequence
_lock = threading.Lock()
_handed: set[int] = set()


def ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux's setting; its default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host`, outside the kernel's ephemeral range, not handed out here before."""
    low = ephemeral_low()
    pool = range(max(1024, low - POOL_SIZE), low)
    with _lock:
        for port in _rng.sample(pool, min(TRIES, len(pool))):
            if port not in _handed and _bindable(host, port):
                _handed.add(port)
                return port
        with socket.socket() as s:  # a crowded or unusual range: the kernel's choice after all
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed.add(port)
        return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
