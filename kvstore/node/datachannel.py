"""The data channel: bulk block bytes over a TCP socket, straight from and into the arena.

Framing (all integers little-endian; see ``protos/kvstore/v1/DATA_CHANNEL.md``; the codec is
:mod:`kvstore.framing`, shared with the SDK)::

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

Floods and slow peers (what bounds what one peer can hold):

* **Connections.**  :class:`ConnectionCaps` admits a connection only under a total cap and a
  per-peer-address cap, both below the process's open-file limit (see
  :func:`raise_open_files_limit`); one over a cap is closed at accept.  A connection must
  present its first request frame (after the TLS handshake) within
  ``FIRST_FRAME_TIMEOUT_S``; an idle pooled one, after a transfer, within ``IDLE_TIMEOUT_S``.
* **Accept errors.**  ``EMFILE``/``ENFILE``/``ENOBUFS``/``ENOMEM`` (the process or the
  host is out of descriptors or memory) back the accept loop off, up to a second, and are
  logged at most every few seconds; the loop keeps going and serves again as soon as
  descriptors are free.  It ends only when the server is closed.
* **Transfers.**  A transfer holds leases (GET) or reservations (PUT) that the reaper cannot
  end while it runs, so its duration is bounded: it is cut at ``max(the id's own deadline,
  start + size / min_rate) + TRANSFER_GRACE_S``, and ends as a failed transfer (leases
  released, reservations aborted) however slowly the peer reads or writes.

Owner of ``_conns``, ``_busy`` and the caps' counts: ``_lock`` (taken by the accept thread and
the connection threads, never across I/O).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import ssl
import threading
import time
from collections import Counter
from typing import Any

# the frame codec, shared with the SDK (the frame names stay importable from here)
from kvstore.framing import COUNT, OP_GET, OP_PUT, REPLY, REPLY_MAGIC, REQUEST, REQUEST_MAGIC, STATUS_OK
from kvstore.framing import TransferCut as _TransferCut
from kvstore.framing import recv_exact_small as _recv_exact_small
from kvstore.framing import recv_into_exact as _recv_into_exact
from kvstore.framing import send_by as _send_by
from kvstore.node.transfers import Transfer, Transfers

log = logging.getLogger(__name__)

FIRST_FRAME_TIMEOUT_S = 5.0  # a new connection must finish its handshake and send its request by then
IDLE_TIMEOUT_S = 300.0  # a pooled connection may wait this long between transfers
TRANSFER_GRACE_S = 2.0  # added to every transfer's bound: connection set-up, a slow first window
DEFAULT_MIN_RATE = 8 << 20  # bytes/s a transfer may not fall below, on average, once its own deadline passed
MAX_CONNECTIONS = 4096  # the total cap's ceiling, whatever the open-file limit
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_WARN_EVERY_S = 5.0


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's ``RLIMIT_NOFILE`` soft limit to the hard limit (capped at 2**20:
    an "unlimited" hard limit is not a valid soft one).  Returns ``(soft, hard)`` as they are
    afterwards; a limit that cannot be raised is left as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft, hard


class ConnectionCaps:
    """Admission of data-channel connections: at most ``total`` at once, and at most
    ``per_peer`` from one peer address.  Not thread-safe: the server calls it under its lock.

    Defaults follow the open-file limit: half of it for the data channel (the rest is the
    NVMe tier's, the index's, gRPC's), at most ``MAX_CONNECTIONS``; a quarter of that per peer."""

    def __init__(self, total: int | None = None, per_peer: int | None = None) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fd_share = max(16, soft // 2) if soft != resource.RLIM_INFINITY else MAX_CONNECTIONS
        self.total = total if total is not None else min(MAX_CONNECTIONS, fd_share)
        self.per_peer = per_peer if per_peer is not None else max(8, self.total // 4)
        if self.total < 1 or self.per_peer < 1:
            raise ValueError(f"connection caps must be positive (total={self.total}, per_peer={self.per_peer})")
        self._by_peer: Counter[str] = Counter()
        self._open = 0

    def admit(self, peer: str) -> str | None:
        """Count a new connection from ``peer`` and return None, or return why it is refused."""
        if self._open >= self.total:
            return f"{self._open} connections open, the most the node takes ({self.total})"
        if self._by_peer[peer] >= self.per_peer:
            return f"{self._by_peer[peer]} connections open from {peer}, the most one peer may hold ({self.per_peer})"
        self._open += 1
        self._by_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self._open -= 1
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]

    def __len__(self) -> int:
        return self._open


class _Throttled:
    """A warning logged at most once per ``every`` seconds, with the count of those held back."""

    def __init__(self, every: float = _WARN_EVERY_S) -> None:
        self._every = every
        self._next = 0.0
        self._held = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        more = f" (and {self._held} more like it since the last report)" if self._held else ""
        log.warning(msg + more, *args)
        self._held, self._next = 0, now + self._every


class DataChannelServer:
    """Accepts data-channel connections and moves bytes between sockets and the arena.

    What a transfer id names, and what happens to its leases or reservations, is
    ``transfers``'s (``kvstore/node/transfers.py``): a connection takes its transfer there, moves
    the bytes of the arena views the taken transfer carries, and finishes it there."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        transfers: Transfers,
        loop: asyncio.AbstractEventLoop,
        ssl_context: ssl.SSLContext | None = None,  # TLS on every connection (server side), or plaintext
        caps: ConnectionCaps | None = None,  # default: from the open-file limit
        min_rate: float = DEFAULT_MIN_RATE,  # bytes/s; bounds how long a transfer holds its leases or reservations
    ) -> None:
        if min_rate <= 0:
            raise ValueError(f"min_rate must be positive, got {min_rate}")
        self._caps = caps if caps is not None else ConnectionCaps()
        self._min_rate = float(min_rate)
        self.refused = 0  # connections closed at accept, over a cap
        self.cut = 0  # transfers cut at their bound
        self._accept_trouble = _Throttled()
        self._refusals = _Throttled()
        self._ssl = ssl_context
        self._loop = loop
        self._transfers = transfers
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
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
        """Runs until ``close``: no accept error ends it (see the module docstring)."""
        backoff = 0.0
        while not self._closing.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closing.is_set():
                    return
                if e.errno in _OUT_OF_RESOURCES:
                    backoff = min(1.0, max(0.01, backoff * 2))
                    self._accept_trouble.warn(
                        "data channel: cannot accept a connection: %s; backing off %.2f s and "
                        "retrying (%d connections open; raise `ulimit -n`, or look for a "
                        "connection flood)",
                        e,
                        backoff,
                        len(self._caps),
                    )
                    self._closing.wait(backoff)
                    continue
                if e.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):  # the listener itself is gone
                    log.error("data channel: the listening socket failed (%s); no more connections are accepted", e)
                    return
                log.debug("data channel: accept: %r", e)  # ECONNABORTED, EPROTO, EPERM...: that connection only
                continue
            backoff = 0.0
            self._admit(conn, str(addr[0]))

    def _admit(self, conn: socket.socket, peer: str) -> None:
        with self._lock:
            why = self._caps.admit(peer)
        if why is not None:
            self.refused += 1
            self._refusals.warn("data channel: refused a connection from %s: %s", peer, why)
            conn.close()
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:  # no I/O yet: the handshake runs on the connection's thread
                conn = self._ssl.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="kvstore-data-conn", daemon=True).start()
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: no thread can be started
            self._accept_trouble.warn("data channel: cannot serve a connection from %s: %r", peer, e)
            with self._lock:
                self._conns.discard(conn)
                self._caps.release(peer)
            conn.close()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            # a new connection must finish its handshake and send a whole request frame promptly:
            # one deadline for all of it, so a peer that trickles bytes holds no more than one that is silent
            frame_by = time.monotonic() + FIRST_FRAME_TIMEOUT_S
            if isinstance(conn, ssl.SSLSocket):
                conn.settimeout(FIRST_FRAME_TIMEOUT_S)
                try:
                    conn.do_handshake()
                except (ssl.SSLError, OSError) as e:  # plaintext peer, untrusted client certificate, timeout
                    log.info("data channel: TLS handshake with %s failed: %s", _peer(conn), e)
                    return
            while not self._closing.is_set():
                # the magic first, so a peer that speaks anything else is dropped at once
                # instead of holding a thread while we wait for a full request frame
                if _recv_exact_small(conn, len(REQUEST_MAGIC), frame_by) != REQUEST_MAGIC:
                    return
                rest = _recv_exact_small(conn, REQUEST.size - len(REQUEST_MAGIC), frame_by)
                if rest is None:
                    return
                magic, op, tid = REQUEST.unpack(REQUEST_MAGIC + rest)
                if magic != REQUEST_MAGIC or op not in (OP_GET, OP_PUT):
                    return
                with self._lock:  # counted before the take: a draining node sees it pending or busy, never neither
                    self._busy += 1
                try:
                    transfer = self._call(self._transfers.take(tid, op))
                    if transfer is None:
                        return  # unknown, expired or replayed id: close at once
                    cut_at = self._bound(transfer)
                    try:
                        if op == OP_GET:
                            self._serve_get(conn, transfer, cut_at)
                        elif not self._serve_put(conn, transfer, cut_at):
                            return
                    except _TransferCut:
                        self.cut += 1
                        log.warning(
                            "data channel: cut a %s of %d bytes from %s at its time bound (the peer moved them "
                            "slower than %.0f bytes/s); its %s ended",
                            "get" if op == OP_GET else "put",
                            transfer.nbytes,
                            _peer(conn),
                            self._min_rate,
                            "leases" if op == OP_GET else "reservations",
                        )
                        return
                finally:
                    with self._lock:
                        self._busy -= 1
                frame_by = (
                    time.monotonic() + IDLE_TIMEOUT_S
                )  # a pooled connection may wait a while for its next transfer
        except (OSError, ConnectionError) as e:
            log.debug("data channel connection ended: %r", e)
        except RuntimeError:  # loop closed during shutdown
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._caps.release(peer)
            conn.close()

    def _bound(self, t: Transfer) -> float:
        """When ``t`` is cut (``time.monotonic``; ``t.deadline`` is the manager's clock, the same one)."""
        return max(t.deadline, time.monotonic() + t.nbytes / self._min_rate) + TRANSFER_GRACE_S

    def _serve_get(self, conn: socket.socket, t: Transfer, cut_at: float) -> None:
        ok = False
        try:
            _send_by(conn, memoryview(REPLY.pack(REPLY_MAGIC, STATUS_OK)), cut_at)
            for views in t.views:
                for view in views:
                    _send_by(conn, view, cut_at)
            ok = True
        finally:
            self._call(self._transfers.finish_get(t, ok))

    def _serve_put(self, conn: socket.socket, t: Transfer, cut_at: float) -> bool:
        complete = False
        try:
            for views in t.views:
                for view in views:
                    if not _recv_into_exact(conn, view, deadline=cut_at):
                        return False
            complete = True
        finally:
            statuses = self._call(self._transfers.finish_put(t, complete))
        conn.settimeout(FIRST_FRAME_TIMEOUT_S)  # the reservations are resolved: only the reply is left to send
        conn.sendall(REPLY.pack(REPLY_MAGIC, STATUS_OK) + COUNT.pack(len(statuses)) + bytes(statuses))
        return True


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed peer"
