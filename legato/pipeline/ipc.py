"""Addresses of the Unix sockets between a server and its worker processes.

On Linux they live in the abstract socket namespace: nothing is written to the filesystem, and the kernel
drops an address when its last holder exits, so a server or worker killed with SIGKILL leaves nothing in
`/tmp`. Elsewhere they are files under `/tmp`, removed on an orderly stop. Names derive from the server's
instance id (pid + random suffix), so many servers share a host.
"""

from __future__ import annotations

import contextlib
import os
import sys

ABSTRACT = sys.platform.startswith("linux")


def _name(instance_id: str, suffix: str) -> str:
    return f"legato-{instance_id}-{suffix}"  # short: a socket address holds at most ~107 bytes


def socket_address(instance_id: str, suffix: str) -> str:
    """For `socket.AF_UNIX` bind/connect: a leading NUL puts the name in the abstract namespace."""
    name = _name(instance_id, suffix)
    return f"\0{name}" if ABSTRACT else f"/tmp/{name}"


def zmq_endpoint(instance_id: str, suffix: str) -> str:
    """The same address as a ZMQ `ipc://` endpoint (ZMQ spells the abstract namespace with '@')."""
    name = _name(instance_id, suffix)
    return f"ipc://@{name}" if ABSTRACT else f"ipc:///tmp/{name}"


def remove(address: str) -> None:
    """Removes the file behind a socket address or endpoint (abstract addresses have none)."""
    if address.startswith("tcp://"):
        return
    path = address.removeprefix("ipc://")
    if path.startswith(("\0", "@")):
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
