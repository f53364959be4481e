"""The data channel: bulk block bytes over a TCP socket, straight from and into the arena.

Framing (all integers little-endian; see ``protos/kvstore/v1/DATA_CHANNEL.md``)::

    client → node   request   "KVDC" u8 op (1 GET, 2 PUT) 3x pad, 16-byte transfer id
    GET:  node → client  "KVDS" u32 status; if status == 0, each hit block's payload
                         (payload_len bytes, in the order StartGet listed them)
    PUT:  client → node  each OK block's payload (payload_len bytes, in StartPut order)
          node → client  "KVDS" u32 status, u32 n, n × u8 KeyStatus

A transfer id is 16 random bytes that only an authenticated ``StartGet``/``StartPut``
call hands out, valid once and until its deadline: it is the capability for the
bytes.  A connection whose first frame is malformed or names no live transfer is
closed at once, having read nothing more and written nothing.

With TLS configured (``ssl_context``, built by :mod:`kvstore.tls`), every accepted socket is
wrapped before its first byte is read; the handshake runs on the connection's own thread
under the first-frame timeout, so a client that never completes it holds nothing else up,
and one that speaks plaintext (or presents no trusted certificate under mutual TLS) is
closed at the handshake.  The framing inside is unchanged; ``sendall`` and ``recv_into``
on the TLS socket still move the arena's memoryviews without an intermediate copy in
Python (OpenSSL encrypts from them and decrypts into them).

Threads: one accept thread and one thread per connection do the blocking socket I/O
(``sendall`` / ``recv_into`` release the GIL).  Everything they need from the node's
state goes through the event loop (``run_coroutine_threadsafe``): the loop stays the
single owner of the index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

from kvstore.block import BlockMeta
from tiers.allocator import Extent
from tiers.arena import Arena

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<4sB3x16s")
REPLY = struct.Struct("<4sI")
COUNT = struct.Struct("<I")
REQUEST_MAGIC = b"KVDC"
REPLY_MAGIC = b"KVDS"
OP_GET = 1
OP_PUT = 2
STATUS_OK = 0
STATUS_EXPIRED = 1
FIRST_FRAME_TIMEOUT_S = 10.0


@dataclasses.dataclass(slots=True)
class Transfer:
    op: int
    deadline: float
    # GET: (lease_id, meta, extents); PUT: (reservation_id, meta, extents)
    items: list[tuple[int, BlockMeta, list[Extent]]]


class TransferTable:
    """Pending transfers by id.  Owned by the event loop."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._pending: dict[bytes, Transfer] = {}

    def add(self, transfer: Transfer) -> bytes:
        tid = secrets.token_bytes(16)
        self._pending[tid] = transfer
        return tid

    def take(self, tid: bytes, op: int) -> Transfer | None:
        t = self._pending.get(tid)
        if t is None or t.op != op:
            return None
        del self._pending[tid]
        return t

    def expire(self) -> list[Transfer]:
        now = self._clock()
        gone = [tid for tid, t in self._pending.items() if t.deadline <= now]
        return [self._pending.pop(tid) for tid in gone]

    def __len__(self) -> int:
        return len(self._pending)


class DataChannelServer:
    """Accepts data-channel connections and moves bytes between sockets and the arena."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        arena: Arena,
        loop: asyncio.AbstractEventLoop,
        take: Callable[[bytes, int], Any],  # coroutine fn: (tid, op) -> Transfer | None
        finish_get: Callable[[Transfer, bool], Any],  # coroutine fn: release leases
        finish_put: Callable[[Transfer, bool], Any],  # coroutine fn: commit (True) or abort -> list[int]
        on_bytes: Callable[[str, int], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,  # TLS on every connection (server side), or plaintext
    ) -> None:
        self._arena = arena
        self._ssl = ssl_context
        self._loop = loop
        self._take = take
        self._finish_get = finish_get
        self._finish_put = finish_put
        self._on_bytes = on_bytes or (lambda path, n: None)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.address = self._sock.getsockname()[:2]
        self._closing = threading.Event()
        self._conns: set[socket.socket] = set()
        self._busy = 0  # transfers between their request frame and their reply: what a drain waits for
        self._lock = threading.Lock()  # guards _conns and _busy
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-data-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for c in list(self._conns):
                try:
                    # the TCP shutdown only: SSLSocket.shutdown would also drop the TLS state
                    # under the connection's thread, which may be inside a read or write
                    socket.socket.shutdown(c, socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def busy(self) -> int:
        """Transfers under way (from the request frame to the last byte of the reply)."""
        return self._busy

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:  # no I/O yet: the handshake runs on the connection's thread
                try:
                    conn = self._ssl.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError) as e:
                    log.debug("data channel: cannot wrap an accepted socket: %r", e)
                    conn.close()
                    continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            idle_timeout = FIRST_FRAME_TIMEOUT_S  # a new connection must speak promptly
            if isinstance(conn, ssl.SSLSocket):
                conn.settimeout(FIRST_FRAME_TIMEOUT_S)
                try:
                    conn.do_handshake()
                except (ssl.SSLError, OSError) as e:  # plaintext peer, untrusted client certificate, timeout
                    log.info("data channel: TLS handshake with %s failed: %s", _peer(conn), e)
                    return
            while not self._closing.is_set():
                conn.settimeout(idle_timeout)
                # the magic first, so a peer that speaks anything else is dropped at once
                # instead of holding a thread while we wait for a full request frame
                if _recv_exact_small(conn, len(REQUEST_MAGIC)) != REQUEST_MAGIC:
                    return
                rest = _recv_exact_small(conn, REQUEST.size - len(REQUEST_MAGIC))
                if rest is None:
                    return
                magic, op, tid = REQUEST.unpack(REQUEST_MAGIC + rest)
                if magic != REQUEST_MAGIC or op not in (OP_GET, OP_PUT):
                    return
                with self._lock:  # counted before the take: a draining node sees it pending or busy, never neither
                    self._busy += 1
                try:
                    transfer = self._call(self._take(tid, op))
                    if transfer is None:
                        return  # unknown, expired or replayed id: close at once
                    conn.settimeout(FIRST_FRAME_TIMEOUT_S * 6)
                    idle_timeout = 300.0  # idle pooled connections may wait a while between transfers
                    if op == OP_GET:
                        self._serve_get(conn, transfer)
                    elif not self._serve_put(conn, transfer):
                        return
                finally:
                    with self._lock:
                        self._busy -= 1
        except (OSError, ConnectionError) as e:
            log.debug("data channel connection ended: %r", e)
        except RuntimeError:  # loop closed during shutdown
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_get(self, conn: socket.socket, t: Transfer) -> None:
        ok = False
        try:
            conn.sendall(REPLY.pack(REPLY_MAGIC, STATUS_OK))
            sent = 0
            for _lid, meta, extents in t.items:
                for view in self._arena.views(extents, meta.payload_len):
                    conn.sendall(view)
                sent += meta.payload_len
            ok = True
            self._on_bytes("tcp_out", sent)
        finally:
            self._call(self._finish_get(t, ok))

    def _serve_put(self, conn: socket.socket, t: Transfer) -> bool:
        complete = False
        try:
            got = 0
            for _rid, meta, extents in t.items:
                for view in self._arena.views(extents, meta.payload_len):
                    if not _recv_into_exact(conn, view):
                        return False
                got += meta.payload_len
            complete = True
            self._on_bytes("tcp_in", got)
        finally:
            statuses = self._call(self._finish_put(t, complete))
        conn.sendall(REPLY.pack(REPLY_MAGIC, STATUS_OK) + COUNT.pack(len(statuses)) + bytes(statuses))
        return True


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed peer"


def _recv_exact_small(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_into_exact(conn, memoryview(buf)) else None


def _recv_into_exact(conn: socket.socket, view: memoryview, hasher: Any = None) -> bool:
    """Fill ``view`` from ``conn``; False on a clean or abrupt end of stream.

    ``hasher`` (an xxhash object), if given, is fed each piece as it lands."""
    pos, n = 0, view.nbytes
    while pos < n:
        got = conn.recv_into(view[pos:], n - pos)
        if got == 0:
            return False
        if hasher is not None:
            hasher.update(view[pos : pos + got])
        pos += got
    return True
