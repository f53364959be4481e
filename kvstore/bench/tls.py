"""The ``tls`` path of ``kvstore bench``: the TLS data channel against a raw TLS socket.

``kvstore bench --paths local,tcp,tls`` measures batched puts and gets through a private
node that serves TLS (a throwaway CA and certificate from :func:`kvstore.local.ca.make`, which needs the
``cryptography`` package: the ``tls`` extra), next to a raw TLS socket reference: the same
``sendall`` → ``recv_into`` loop as the plaintext socket reference, its far end in another
process, wrapped with the very contexts the node's data channel and the SDK build
(:mod:`kvstore.tls`), so both negotiate the same protocol version and cipher; both are
reported.  The ratios say what the data channel's framing, leases and checksums cost on
top of the encryption itself (``tls_get_vs_tls_socket``), and what TLS costs against the
plaintext data channel (``tls_get_vs_tcp``).

Owns nothing beyond one run: the node, the peer and the certificate files live in the
benchmark's temporary directory and go with it (``TLSBench.close``).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, TextIO


def throwaway_certificates(directory: Path) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 / localhost it signed: (ca, cert, key) PEM paths."""
    from kvstore.local.ca import make

    c = make(directory, ["127.0.0.1", "localhost"], name="kvstore bench", days=1, overwrite=True)
    return c.ca, c.cert, c.key


class TLSBench:
    """A private TLS node, the SDK options that reach it, and the raw TLS socket reference."""

    def __init__(self, workdir: Path, dram: int, capacity: int) -> None:
        from kvstore.bench.nodes import private_node
        from kvstore.bench.refs import SocketPeer
        from kvstore.tls import ClientTLS

        self.ca, cert, key = throwaway_certificates(workdir / "tls")
        self.client_kw: dict[str, Any] = {"tls_ca_file": self.ca}
        client = ClientTLS.from_options(ca_file=self.ca)
        assert client is not None  # a CA file always makes TLS settings
        self._closers: list[Any] = []
        try:
            self.node = private_node(dram, workdir, extra=("--tls-cert-file", cert, "--tls-key-file", key), tag="tls")
            self._closers.append(self.node.stop)
            self.target = self.node.endpoints["grpc"]
            self.peer = SocketPeer(
                capacity,
                main="from kvstore.bench.tls import peer_main as m; m()",
                args=(cert, key),
                wrap=lambda sock: client.wrap(sock, "127.0.0.1"),
            )
            self._closers.append(self.peer.close)
            sock = self.peer.s
            assert isinstance(sock, ssl.SSLSocket)  # wrapped by ``client.wrap`` above
            cipher = sock.cipher()
            self.socket_cipher = f"{sock.version()} {cipher[0] if cipher else '?'}"
        except BaseException:
            self.close()
            raise

    @staticmethod
    def sdk_cipher(kv: Any) -> str:
        """The cipher a client's data-channel connections negotiated (its pool keeps them)."""
        pool = getattr(kv._core.transport, "pool", None)  # the data channel's (client._transports.DataChannel)
        for s in getattr(pool, "_idle", []):
            c = s.cipher() if hasattr(s, "cipher") else None
            if c:
                return f"{s.version()} {c[0]}"
        return "unknown"

    def close(self) -> None:
        for fn in reversed(self._closers):
            try:
                fn()
            except Exception:  # best-effort teardown of a benchmark
                pass
        self._closers = []


def ratios(at: Any, ref: dict[str, Any]) -> dict[str, float | None]:
    """TLS ratios at the reference size; ``at(path, key)`` reads a path's figure."""
    from kvstore.bench.kit import ratio

    return {
        "tls_get_vs_tls_socket": ratio(at("tls", "get_gbps"), ref["tls_socket_gbps"]),
        "tls_put_vs_tls_socket": ratio(at("tls", "put_gbps"), ref["tls_socket_put_gbps"]),
        "tls_get_vs_tcp": ratio(at("tls", "get_gbps"), at("tcp", "get_gbps")),
        "tls_put_vs_tcp": ratio(at("tls", "put_gbps"), at("tcp", "put_gbps")),
    }


def print_summary(r: dict[str, Any], f: TextIO) -> None:
    t, q = r["tls"], r["ratios"]
    x = lambda v: f"{v:.2f}x" if v else "-"  # noqa: E731
    print(
        f"TLS at {r['ref_size']} ({t['cipher']}; socket reference {t['socket_cipher']}): data-channel get "
        f"{x(q.get('tls_get_vs_tls_socket'))} the raw TLS socket, {x(q.get('tls_get_vs_tcp'))} the plaintext data channel; "
        f"put {x(q.get('tls_put_vs_tls_socket'))}, {x(q.get('tls_put_vs_tcp'))}",
        file=f,
    )


def peer_main() -> None:
    """The TLS socket reference's far end: the plaintext peer's loop over the node's own
    data-channel context (``argv``: capacity, certificate, key)."""
    import sys

    from kvstore.bench.refs import socket_peer_main
    from kvstore.tls import ServerTLS

    ctx = ServerTLS.load(sys.argv[2], sys.argv[3]).context
    socket_peer_main(lambda s: ctx.wrap_socket(s, server_side=True))
