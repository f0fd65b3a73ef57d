"""The server's listening socket, bound before anything loads.

`legato serve` used to load the whole model, log "listening", and only then find its port taken (19 s on
the tiny model, minutes on a real one). Binding first turns that into a one-line error at once. The socket
is only bound here: uvicorn calls listen() when it starts serving, so a client that connects while the
model loads is refused at once rather than left waiting in a backlog.
"""

from __future__ import annotations

import errno
import socket


def bind_listener(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds its own (SO_REUSEADDR, IPv6 for a host with a
    colon); `reuse_port`: one of a SO_REUSEPORT group (the fronts of `--fronts N`). ValueError with one line
    saying what to change when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (0-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # What uvicorn sets: a restarted server may bind while the old one's connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise ValueError(_bind_problem(host, port, e)) from e
    return sock


def _bind_problem(host: str, port: int, e: OSError) -> str:
    where = f"{host}:{port}"
    if e.errno == errno.EADDRINUSE:
        return f"cannot listen on {where}: the port is already in use (another server?); stop it or pick another --port"
    if e.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need privileges); pick another --port"
    if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
        return f"cannot listen on {where}: this machine has no such address; check --host"
    return f"cannot listen on {where}: {e.strerror or e}"
