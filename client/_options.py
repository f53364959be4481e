"""What a client is configured with: :class:`ClientOptions` (one frozen value for every
client class) and :class:`Timeouts`.

``KVClient``, ``AsyncKVClient`` and :func:`client.connect` take ``options=ClientOptions(...)``
or the same fields as keyword arguments (the form before 0.x; still accepted), not both
for one field.  Values only: files named here (token, TLS) are read by the client that
uses them, once, when it is made.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypedDict

from kvstore.errors import InvalidArgument
from kvstore.tls import ClientTLS
from kvstore.wire import check_agent

if TYPE_CHECKING:
    from client._transports import Transport


@dataclasses.dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds.  ``rpc``: each control call; ``data``: socket I/O of a transfer; ``connect``: opening sockets."""

    rpc: float = 10.0
    data: float = 60.0
    connect: float = 5.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions:
    """How a client reaches and talks to its node (or, for ``etcd://`` targets, to every node).

    ``token`` / ``token_file``: the bearer token (else ``KVSTORE_TOKEN`` / ``KVSTORE_TOKEN_FILE``;
    none: no auth).  ``transport``: ``"auto"`` (shared memory for ``unix://`` targets, the data
    channel for ``host:port``), ``"shm"``, ``"data-channel"`` or ``"grpc-stream"``.  ``verify``:
    check every payload's checksum on reads.  TLS, for ``host:port`` targets of a node started
    with ``tls_cert_file``: ``tls_ca_file`` (PEM roots that verify the node; ``tls=True`` alone
    uses the system's roots), ``tls_cert_file`` / ``tls_key_file`` (a client certificate, for
    nodes that require one) and ``tls_server_name`` (the name to verify instead of the host
    dialled).  ``agent``: which integration makes the calls (``"vllm-connector"``,
    ``"sglang-hicache"``, ...; 1-48 of ``[A-Za-z0-9._-]``): sent with every call, so the node's
    metrics and the dashboard count lookups, hits, bytes and time per agent ("" = a plain SDK
    client, counted as ``sdk``)."""

    token: str | None = None
    token_file: str | None = None
    timeouts: Timeouts | None = None
    transport: str | Transport = "auto"  # a name, or a Transport object (tests: an in-process fake)
    verify: bool = True
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_server_name: str | None = None
    agent: str = ""

    def __post_init__(self) -> None:
        check_agent(self.agent)

    @classmethod
    def of(cls, options: ClientOptions | None, kwargs: dict[str, Any], *, extra: tuple[str, ...] = ()) -> ClientOptions:
        """``options`` with the keyword arguments a constructor received applied on top.

        ``extra``: keyword names the caller handles itself (ignored here).  An unknown name is a
        ``TypeError``, as for any function; one given both ways is an ``InvalidArgument``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields - set(extra))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; client options are {sorted(fields)}")
        given = {k: v for k, v in kwargs.items() if k in fields}
        if options is None:
            return cls(**given)
        if not isinstance(options, ClientOptions):
            raise InvalidArgument(f"options must be a ClientOptions, got {type(options).__name__}")
        both = sorted(k for k in given if getattr(options, k) != getattr(cls(), k))
        if both:
            raise InvalidArgument(f"{', '.join(both)} given both in options and as keyword arguments")
        return dataclasses.replace(options, **given) if given else options

    def client_tls(self) -> ClientTLS | None:
        """The TLS settings these options name, None for plaintext (files are read now: a bad one fails here)."""
        return ClientTLS.from_options(
            tls=self.tls,
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            server_name=self.tls_server_name,
        )


class ClientKwargs(TypedDict, total=False):
    """The keyword-argument spelling of :class:`ClientOptions` (for ``**kwargs: Unpack[...]``)."""

    token: str | None
    token_file: str | None
    timeouts: Timeouts | None
    transport: str | Transport
    verify: bool
    tls: bool
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_server_name: str | None
    agent: str
