"""Where a server listens and who can reach it. Light imports only: rlserve.cli checks before it starts
anything, and a deployment's parent binds its admin port, without importing torch or the server stack."""

from __future__ import annotations

import ipaddress
import socket

from rlserve.config.schema import Config


def check_admin_exposure(config: Config) -> None:
    """Admin routes replace what every user is served: off loopback they need a key or an explicit opt-out."""
    server = config.server
    if server.admin_api_key or server.allow_open_admin or is_loopback(server.host):
        return
    raise SystemExit(
        f"rlserve: error: server.host {server.host!r} is reachable from other machines and server.admin_api_key "
        "is not set, so anyone could replace the served weights: set --server.admin_api_key KEY, bind "
        "--server.host 127.0.0.1, or pass --server.allow_open_admin true to serve admin routes without a key"
    )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:  # a host name: loopback only if every address it names is
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    # listening before the URL is printed: a client that reads it may connect at once, and its connection
    # waits in the backlog until uvicorn starts accepting instead of being refused
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
