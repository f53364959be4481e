"""One exception hierarchy for the node, the tiers and the SDK.

A cache miss is never an exception: lookups return ``None`` or a result object.
These exceptions are for contract violations (bad input), capacity, transport
and corruption.  They cross gRPC as status codes, and both directions are one table in
one place, ``kvstore/wire.py``: ``status_for`` (the node's servicer aborts a call with it)
and ``error_from_rpc`` (the SDK raises what it returns).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class InvalidArgument(KVStoreError, ValueError):
    """The caller passed something malformed: a key that is not 16 bytes, a bad size, an unknown config key."""


class Incompatible(KVStoreError):
    """Data or a peer speaks another format version, namespace or layout."""


class CapacityExceeded(KVStoreError):
    """The request can never fit (bigger than the tier), or no space can be freed right now."""


class Unavailable(KVStoreError):
    """The node (or etcd) cannot be reached, or is shutting down."""


class OwnershipUnavailable(Unavailable):
    """A tenant's write to a namespace the node does not know yet, refused because etcd,
    where a cluster agrees on namespace owners, did not answer.  The node itself is up:
    calls in namespaces it already knows keep working."""


class DeadlineExceeded(KVStoreError):
    """The call did not finish within its deadline."""


class Unauthenticated(KVStoreError):
    """A missing or wrong bearer token."""


class PermissionDenied(KVStoreError):
    """A valid token whose tenant may not do this: write, delete, pin or invalidate in a
    namespace another tenant owns (reads of such blocks are misses, never this error)."""


class NotFound(KVStoreError):
    """A handle (reservation, lease, transfer) that does not exist or has expired.

    Not used for cache misses: those are results.
    """


class DataDirLocked(KVStoreError):
    """Another running node owns this data directory."""


class BlockFormatError(KVStoreError):
    """Stored or received block bytes that cannot be trusted."""


class TruncatedBlock(BlockFormatError):
    """Fewer bytes than the header promises."""


class CorruptBlock(BlockFormatError):
    """A magic, header checksum or payload checksum that does not match."""


class UnsupportedVersion(BlockFormatError, Incompatible):
    """A block written by a format version this code does not read."""


class NamespaceMismatch(BlockFormatError, Incompatible):
    """A block whose namespace fingerprint (or key) is not the one asked for."""
