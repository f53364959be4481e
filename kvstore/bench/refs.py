"""The references ``kvstore bench`` measures its paths against, in the same run (architecture §14, §15).

One concern each, none of them kvstore code:

* **memcpy**: one-thread ``np.copyto`` over the same working set into the same
  destination buffers (the local paths and the DRAM tier).
* **O_DIRECT disk**: sequential ``pwrite``+``fdatasync`` (one sync per group, as the
  NVMe tier's group commits) and ``pread`` of the same bytes, on the same filesystem,
  with the page cache dropped before reads where allowed (the NVMe tier).
* **raw socket**: ``sendall`` → ``recv_into`` over loopback TCP, the far end in another
  process like the node (the TCP paths); ``wrap`` turns it into the raw TLS socket
  reference of the TLS path (:mod:`kvstore.bench.tls`).
* **Redis**: a private ``redis-server`` spoken to in RESP, replies read with ``recv_into``.

Each owns only what it starts (a file descriptor, a peer process, a Redis process) and
gives it back in ``close``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import children
from kvstore.bench.kit import batched, blocks, buffer
from kvstore.cluster.local_etcd import free_port
from kvstore.errors import Unavailable


# -- memcpy ---------------------------------------------------------------------------------
def memcpy(src: Sequence[np.ndarray], dst: Sequence[np.ndarray]) -> None:
    for s, d in zip(src, dst):
        np.copyto(d, s)


# -- O_DIRECT disk --------------------------------------------------------------------------
def drop_caches() -> bool:
    """Drop the page cache so reads come from the disk (needs root); False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _pread_all(fd: int, view: memoryview, off: int) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], off)
        if n <= 0:
            raise OSError(f"short read at {off}")
        view, off = view[n:], off + n


class DirectIOFile:
    """A preallocated file of ``nbytes`` written and read block by block at fixed offsets,
    with ``O_DIRECT`` when ``direct`` (the NVMe tier's setting on the same filesystem)."""

    def __init__(self, path: Path, nbytes: int, *, direct: bool) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, src: Sequence[np.ndarray], block_bytes: int, batch: int) -> None:
        """Every block at its offset, one ``fdatasync`` per ``batch`` blocks (the tier's group commits)."""
        for group in batched(range(len(src)), batch):
            for j in group:
                _pwrite_all(self.fd, memoryview(src[j]), j * block_bytes)
            os.fdatasync(self.fd)

    def read_into(self, dst: Sequence[np.ndarray], block_bytes: int) -> None:
        for j, d in enumerate(dst):
            _pread_all(self.fd, d.data, j * block_bytes)

    def close(self) -> None:
        os.close(self.fd)


# -- raw socket (and, wrapped, raw TLS socket) ---------------------------------------------
_PEER_REQ = struct.Struct("<cQQ")  # op (G: peer sends, P: peer receives, Q: quit), block size, count


def _recv_exact(s: socket.socket, view: memoryview) -> None:
    pos, n = 0, view.nbytes
    while pos < n:
        got = s.recv_into(view[pos:], n - pos)
        if not got:
            raise Unavailable("socket closed mid-transfer")
        pos += got


def socket_peer_main(wrap: Callable[[socket.socket], socket.socket] | None = None) -> None:
    """The raw-socket reference's far end, in its own process (like the node); ``wrap``: TLS (benchtls.py)."""
    cap = int(sys.argv[1])
    buf = buffer(cap, pattern=True)
    ls = socket.create_server(("127.0.0.1", 0))
    print(ls.getsockname()[1], flush=True)
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s = wrap(s) if wrap else s
    head = bytearray(_PEER_REQ.size)
    while True:
        _recv_exact(s, memoryview(head))
        op, size, count = _PEER_REQ.unpack(head)
        if op not in (b"G", b"P") or not 0 < size <= cap:
            return
        views = blocks(buf, size)
        if op == b"G":
            for i in range(count):
                s.sendall(views[i % len(views)].data)
        elif op == b"P":
            for i in range(count):
                _recv_exact(s, views[i % len(views)].data)
            s.sendall(b"K")


class SocketPeer:
    """The raw-socket reference: a peer process (``socket_peer_main``) and one connection to it."""

    _MAIN = "from kvstore.bench.refs import socket_peer_main as m; m()"

    def __init__(
        self, capacity: int, *, main: str = _MAIN, args: Sequence[str] = (), wrap: Callable[[Any], Any] = lambda s: s
    ) -> None:
        self.proc = children.spawn(
            [sys.executable, "-c", main, str(capacity), *args], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.s = wrap(self.s)

    def get(self, dst: Sequence[np.ndarray]) -> None:
        self.s.sendall(_PEER_REQ.pack(b"G", dst[0].size, len(dst)))
        for d in dst:
            _recv_exact(self.s, d.data)

    def put(self, src: Sequence[np.ndarray]) -> None:
        self.s.sendall(_PEER_REQ.pack(b"P", src[0].size, len(src)))
        for v in src:
            self.s.sendall(v.data)
        _recv_exact(self.s, memoryview(bytearray(1)))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.s.sendall(_PEER_REQ.pack(b"Q", 0, 0))
            self.s.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)  # it exits on the quit frame
        children.stop(self.proc, timeout=0.1, sig=signal.SIGKILL)


# -- Redis ----------------------------------------------------------------------------------
class Redis:
    """A private ``redis-server`` and a minimal RESP client that reads values with ``recv_into``."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.port = free_port()
        self.proc = children.spawn(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
                str(workdir),
                "--proto-max-bulk-len",
                "1gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.s = socket.create_connection(("127.0.0.1", self.port), timeout=1)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise Unavailable(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        self.s.settimeout(60)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending = bytearray()
        self.command(b"PING")
        self.version = self.command(b"INFO", b"server").split(b"redis_version:")[1].split(b"\r\n")[0].decode()

    @staticmethod
    def _head(*args: bytes, tail: int | None = None) -> bytes:
        parts = [b"*%d\r\n" % (len(args) + (tail is not None))]
        parts += [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
        if tail is not None:
            parts.append(b"$%d\r\n" % tail)
        return b"".join(parts)

    def _line(self) -> bytes:
        while (i := self._pending.find(b"\r\n")) < 0:
            chunk = self.s.recv(65536)
            if not chunk:
                raise Unavailable("redis closed the connection")
            self._pending += chunk
        line = bytes(self._pending[:i])
        del self._pending[: i + 2]
        if line.startswith(b"-"):
            raise Unavailable(f"redis: {line[1:].decode(errors='replace')}")
        return line

    def _read_into(self, view: memoryview) -> None:
        n = min(len(self._pending), view.nbytes)
        view[:n] = self._pending[:n]
        del self._pending[:n]
        _recv_exact(self.s, view[n:])

    def command(self, *args: bytes) -> bytes:
        self.s.sendall(self._head(*args))
        line = self._line()
        if line.startswith(b"$"):
            buf = memoryview(bytearray(int(line[1:]) + 2))
            self._read_into(buf)
            return bytes(buf[:-2])
        return line

    def set_many(self, keys: Sequence[bytes], values: Sequence[np.ndarray]) -> None:
        for k, v in zip(keys, values):  # pipelined: all commands, then all replies
            self.s.sendall(self._head(b"SET", k, tail=v.nbytes))
            self.s.sendall(v.data)
            self.s.sendall(b"\r\n")
        for _ in keys:
            if self._line() != b"+OK":
                raise Unavailable("redis SET failed")

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> None:
        self.s.sendall(b"".join(self._head(b"GET", k) for k in keys))
        for out in outs:
            if int(self._line()[1:]) != out.nbytes:
                raise Unavailable("redis GET returned a missing or wrong-sized value")
            self._read_into(out.data)
            self._line()  # the CRLF after the bulk string

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.s.close()
        children.stop(self.proc, timeout=10)
