"""Client side of the data channel (frame codec in :mod:`kvstore.framing`, shared with the node).

A small pool of blocking TCP connections to one node.  Each transfer takes a
connection, moves the bytes with ``sendall`` / ``recv_into`` straight from or into
the caller's buffers, and returns the connection to the pool; a connection that saw
any error is closed, never reused.  Thread-safe (the pool has its own lock).

With ``tls`` (a :class:`kvstore.tls.ClientTLS`, owned by the client that made the pool)
each new connection is TLS-wrapped, handshake included, under the connect timeout; the
transfers then call the same ``sendall`` / ``recv_into`` on the TLS socket, which
encrypt from and decrypt into the caller's memoryviews directly.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import xxhash

from kvstore.errors import DeadlineExceeded, Unavailable
from kvstore.framing import (
    COUNT,
    OP_GET,
    OP_PUT,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    STATUS_OK,
    recv_into_exact,
)
from kvstore.tls import explain


class DataChannelPool:
    def __init__(
        self, host: str, port: int, *, connect_timeout: float, io_timeout: float, max_idle: int = 4, tls: Any = None
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls  # kvstore.tls.ClientTLS | None
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._max_idle = max_idle

    def _get(self, *, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A connection and whether it was reused from the pool (the node may have closed it)."""
        with self._lock:
            if self._idle and not fresh:
                return self._idle.pop(), True
        try:
            s = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as e:
            raise Unavailable(f"cannot open the data channel to {self.host}:{self.port}: {e}") from e
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                s = self.tls.wrap(s, self.host)  # the handshake, under the connect timeout
            except OSError as e:
                s.close()
                where = f"{self.host}:{self.port}"
                if isinstance(e, (ssl.SSLEOFError, ConnectionResetError)):  # dropped before the handshake completed
                    raise Unavailable(
                        f"the data channel at {where} closed the connection during the TLS handshake "
                        f"(does the node serve TLS there?): {e}"
                    ) from e
                raise Unavailable(
                    explain(f"TLS handshake on the data channel to {where} failed: {e}", self.tls, where)
                ) from e
        s.settimeout(self.io_timeout)
        return s, False

    def _closed_early(self) -> str:
        hint = "" if self.tls is not None else "; a node serving TLS also closes plaintext connections at once"
        return f"the node closed the data channel (transfer expired or unknown{hint})"

    def _put(self, s: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(s)
                return
        s.close()

    def get(
        self, transfer_id: bytes, outs: Sequence[memoryview], *, hashed: bool = False, _fresh: bool = False
    ) -> list[int]:
        """Receive each expected payload straight into its ``outs`` view (exact sizes).

        With ``hashed``, return each payload's xxh3-64, computed piece by piece as the
        bytes arrive (while they are still in cache) rather than in a second pass."""
        s, reused = self._get(fresh=_fresh)
        ok = False
        try:
            try:
                s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_GET, transfer_id))
                head = bytearray(REPLY.size)
                got_reply = recv_into_exact(s, memoryview(head))
            except ssl.SSLError as e:
                if reused:
                    got_reply = False
                else:  # a fresh TLS connection refused at its first read (TLS 1.3 checks client certificates here)
                    where = f"{self.host}:{self.port}"
                    raise Unavailable(explain(f"data channel TLS error: {e}", self.tls, where)) from e
            except OSError:
                got_reply = False
            if not got_reply:
                if reused:  # the node closed this idle pooled connection before reading our request
                    s.close()
                    return self.get(transfer_id, outs, hashed=hashed, _fresh=True)
                raise Unavailable(self._closed_early())
            magic, status = REPLY.unpack(head)
            if magic != REPLY_MAGIC or status != STATUS_OK:
                raise Unavailable(f"data channel refused the transfer (status {status})")
            sums: list[int] = []
            for out in outs:
                h = xxhash.xxh3_64() if hashed else None
                if not recv_into_exact(s, out, h):
                    raise Unavailable("the data channel closed mid-transfer")
                if h is not None:
                    sums.append(h.intdigest())
            ok = True
            return sums
        except TimeoutError as e:
            raise DeadlineExceeded(f"data channel transfer exceeded {self.io_timeout} s") from e
        except OSError as e:
            raise Unavailable(f"data channel error: {e}") from e
        finally:
            self._put(s) if ok else s.close()

    def put(self, transfer_id: bytes, payloads: Sequence[memoryview]) -> list[int]:
        """Send payloads; return the node's per-block KeyStatus values."""
        s, reused = self._get()
        if reused and _peer_closed(s):  # an idle pooled connection the node has since closed
            s.close()
            s, _ = self._get(fresh=True)
        ok = False
        try:
            s.sendall(REQUEST.pack(REQUEST_MAGIC, OP_PUT, transfer_id))
            for p in payloads:
                s.sendall(p)
            head = bytearray(REPLY.size + COUNT.size)
            if not recv_into_exact(s, memoryview(head)):
                raise Unavailable(self._closed_early())
            magic, status = REPLY.unpack_from(head)
            (n,) = COUNT.unpack_from(head, REPLY.size)
            if magic != REPLY_MAGIC or status != STATUS_OK or n != len(payloads):
                raise Unavailable(f"data channel refused the transfer (status {status})")
            statuses = bytearray(n)
            if n and not recv_into_exact(s, memoryview(statuses)):
                raise Unavailable("the data channel closed before the statuses")
            ok = True
            return list(statuses)
        except TimeoutError as e:
            raise DeadlineExceeded(f"data channel transfer exceeded {self.io_timeout} s") from e
        except OSError as e:
            raise Unavailable(f"data channel error: {e}") from e
        finally:
            self._put(s) if ok else s.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


def _peer_closed(s: socket.socket) -> bool:  # restores the socket's timeout
    """True if the peer has closed (or reset) an idle connection: a non-blocking peek sees EOF.

    TLS sockets cannot peek; a non-blocking read stands in (OpenSSL consumes any session
    tickets on the way): an idle connection has no bytes due, so EOF and unexpected bytes
    both mean it is not reusable."""
    timeout = s.gettimeout()
    try:
        s.setblocking(False)
        try:
            if isinstance(s, ssl.SSLSocket):
                try:
                    s.recv(1)
                    return True
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return False
            return s.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        finally:
            s.settimeout(timeout)
    except OSError:
        return True
