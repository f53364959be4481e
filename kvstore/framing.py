"""The data channel's frame codec, shared by the node (``kvstore/node/datachannel.py``) and the
SDK (``client/_datachannel.py``).

Framing (all integers little-endian; see ``protos/kvstore/v1/DATA_CHANNEL.md``)::

    client → node   request   "KVDC" u8 op (1 GET, 2 PUT) 3x pad, 16-byte transfer id
    GET:  node → client  "KVDS" u32 status; if status == 0, each hit block's payload
                         (payload_len bytes, in the order StartGet listed them)
    PUT:  client → node  each OK block's payload (payload_len bytes, in StartPut order)
          node → client  "KVDS" u32 status, u32 n, n × u8 KeyStatus

This module holds the frame layouts and the blocking socket helpers both ends use to move
bytes into and out of caller-owned memoryviews without a copy in Python.  It owns no state;
the helpers change only the socket's timeout (``time_left``, ``send_by`` and a
``recv_into_exact`` with a deadline set it to what is left of the deadline).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

REQUEST = struct.Struct("<4sB3x16s")
REPLY = struct.Struct("<4sI")
COUNT = struct.Struct("<I")
REQUEST_MAGIC = b"KVDC"
REPLY_MAGIC = b"KVDS"
OP_GET = 1
OP_PUT = 2
STATUS_OK = 0
STATUS_EXPIRED = 1
PIECE = 1 << 20  # send_by sends in pieces of this size, each under the time left to the deadline


class TransferCut(TimeoutError):
    """A transfer ran past its deadline (given to ``time_left``, ``send_by`` or ``recv_into_exact``)."""


def time_left(conn: socket.socket, deadline: float) -> None:
    """Set ``conn``'s timeout to what is left until ``deadline``; raise ``TransferCut`` when nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferCut
    conn.settimeout(left)


def send_by(conn: socket.socket, view: memoryview, deadline: float) -> None:
    """``sendall`` finished by ``deadline``: a socket timeout bounds a whole ``sendall`` (and a TLS
    ``write``), so each piece is sent under the time left."""
    for off in range(0, view.nbytes, PIECE):
        time_left(conn, deadline)
        try:
            conn.sendall(view[off : off + PIECE])
        except TimeoutError:
            raise TransferCut from None


def recv_into_exact(
    conn: socket.socket, view: memoryview, hasher: Any = None, *, deadline: float | None = None
) -> bool:
    """Fill ``view`` from ``conn``; False on a clean or abrupt end of stream.

    ``hasher`` (an xxhash object), if given, is fed each piece as it lands.  ``deadline``
    (``time.monotonic``), if given, bounds the whole fill: past it ``TransferCut`` is raised.
    Without one, the socket's own timeout applies to each ``recv_into`` (``TimeoutError``)."""
    pos, n = 0, view.nbytes
    while pos < n:
        if deadline is not None:
            time_left(conn, deadline)
        try:
            got = conn.recv_into(view[pos:], n - pos)
        except TimeoutError:
            if deadline is None:
                raise
            raise TransferCut from None
        if got == 0:
            return False
        if hasher is not None:
            hasher.update(view[pos : pos + got])
        pos += got
    return True


def recv_exact_small(conn: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``conn`` by ``deadline`` (a frame header), or None at end of stream."""
    buf = bytearray(n)
    return bytes(buf) if recv_into_exact(conn, memoryview(buf), deadline=deadline) else None
