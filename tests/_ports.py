"""Ports for the servers the tests start, safe when several pytest workers run at once.

How it works: a port is taken from below the kernel's ephemeral range (which starts at
32768 by default), so no outgoing connection of any test can hold it between the moment it
is picked and the moment the server binds it, and each pytest-xdist worker has a slice of
its own, so two workers never pick the same one. Within the slice, a port that cannot be
bound right now (another program on the machine) is skipped, and none is issued twice by
one process (servers started one after the other, e.g. a cluster's ports and bus ports).
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port"]

_FIRST = 20000
_SLICE = 1500  # ports per worker: gw0..gw7 fit below 32768
_issued: set[int] = set()
_next: list[int] = []


def _worker_slice() -> range:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    start = _FIRST + (index % 8) * _SLICE
    return range(start, start + _SLICE)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, never issued before by this process."""
    ports = _worker_slice()
    if not _next:  # start at a random place: another run on the machine may use the start
        _next.append(random.randrange(len(ports)))
    for _ in range(len(ports)):
        port = ports[_next[0] % len(ports)]
        _next[0] += 1
        if port not in _issued and _bindable(port):
            _issued.add(port)
            return port
    raise RuntimeError(f"no free port left in {ports.start}-{ports.stop - 1} for this worker")
