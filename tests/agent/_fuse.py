"""A FUSE file system that never answers a read: ``python _fuse.py MOUNTPOINT``.

It mounts itself at MOUNTPOINT (``mount(2)`` on ``/dev/fuse``: root, or CAP_SYS_ADMIN),
prints ``mounted``, and serves one file, ``frozen``: lookups and opens are answered (direct
I/O), reads never are. A process reading it waits in the kernel; once it has been signalled
to die it waits in uninterruptible sleep (``D``), so SIGKILL cannot end it, as with a dead GPU
or a hung NFS server. Killing this server aborts the connection: the reader then dies.
The tests unmount the mountpoint (lazily) afterwards.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header
_INIT, _LOOKUP, _GETATTR, _OPEN, _READ, _RELEASE, _FLUSH, _INTERRUPT = 26, 1, 3, 14, 15, 18, 25, 36
_DIRECT_IO = 1


def _attr(ino: int, mode: int) -> bytes:  # fuse_attr
    return struct.pack("<QQQQQQIIIIIIIIII", ino, 1, 0, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def main() -> int:
    mountpoint = sys.argv[1]
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"aelastic-frozen", mountpoint.encode(), b"fuse", 0, options) != 0:
        print(f"mount failed: {os.strerror(ctypes.get_errno())}", flush=True)
        return 1
    print("mounted", flush=True)

    def reply(unique: int, payload: bytes = b"", error: int = 0) -> None:
        os.write(fd, struct.pack("<IiQ", 16 + len(payload), error, unique) + payload)

    while True:
        try:
            data = os.read(fd, 1 << 20)
        except OSError:
            return 0  # unmounted
        _, opcode, unique, node, *_ = _IN.unpack_from(data)
        body = data[_IN.size :]
        if opcode == _INIT:
            minor, readahead = struct.unpack_from("<4xII", body)
            reply(
                unique,
                struct.pack("<IIIIHHIIHHII", 7, minor, readahead, 0, 16, 12, 4096, 1, 0, 0, 0, 0)
                + bytes(24),
            )
        elif opcode == _GETATTR:
            mode = 0o40755 if node == 1 else 0o100644
            reply(unique, struct.pack("<QII", 1, 0, 0) + _attr(node, mode))
        elif opcode == _LOOKUP:
            if body.rstrip(b"\0") == b"frozen":
                reply(unique, struct.pack("<QQQQII", 2, 0, 1, 1, 0, 0) + _attr(2, 0o100644))
            else:
                reply(unique, error=-errno.ENOENT)
        elif opcode == _OPEN:
            reply(unique, struct.pack("<QII", 0, _DIRECT_IO, 0))
        elif opcode in (_READ, _INTERRUPT):
            pass  # never answered
        elif opcode in (_RELEASE, _FLUSH):
            reply(unique)
        else:
            reply(unique, error=-errno.ENOSYS)


if __name__ == "__main__":
    sys.exit(main())
