"""The instructions a sans-I/O SDK operation yields, and the helpers the transports share.

An operation (a generator, :data:`Op`) yields one of these and gets its result sent back;
a driver (``KVClient._run``, ``AsyncKVClient._run``, or a test's) performs it with a
``match``:

* :class:`Rpc`: the unary gRPC call ``method(request)``; the response comes back;
* :class:`RpcNoWait`: start the call and do not wait (releases whose outcome is known);
  None comes back;
* :class:`Io`: run the blocking ``fn()`` (copies, the data channel): inline in the sync
  client, in a worker thread in the async one; its return value comes back;
* :class:`PutStream`: the client-streaming ``PutStream`` fallback over ``chunks()``, with
  ``blocks`` (if given) declared to the node in metadata; the response comes back;
* :class:`GetStream`: the server-streaming ``GetStream``; the list of chunks comes back.

Errors a driver meets are thrown into the generator, which gives back what it holds
before they propagate.  Owns no state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeAlias, TypeVar

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from protos.kvstore.v1 import kvstore_pb2 as pb

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Rpc:
    method: str
    request: Any


@dataclasses.dataclass(frozen=True, slots=True)
class RpcNoWait:
    method: str
    request: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Io:
    fn: Callable[[], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class PutStream:
    chunks: Callable[[], Iterator[pb.BlockChunk]]
    blocks: int | None = None  # declared to the node (``kvstore.wire.BLOCKS_METADATA_KEY``)


@dataclasses.dataclass(frozen=True, slots=True)
class GetStream:
    request: pb.KeysRequest


Instruction: TypeAlias = Rpc | RpcNoWait | Io | PutStream | GetStream
Op: TypeAlias = Generator[Any, Any, T]  # yields Instruction (or a legacy tuple, see ``instruction``)

_LEGACY: dict[str, Callable[..., Instruction]] = {
    "rpc": Rpc,
    "rpc_nowait": RpcNoWait,
    "io": Io,
    "put_stream": PutStream,
    "get_stream": GetStream,
}


def instruction(instr: Instruction | tuple[Any, ...]) -> Instruction:
    """``instr`` as an :data:`Instruction`.  Operations written against the 0.x tuple form
    (``("rpc", method, request)``, ``("put_stream", chunks, n)``, ...) are still accepted, for
    one release: the cluster router's per-node operations yield them."""
    if isinstance(instr, tuple):
        try:
            return _LEGACY[instr[0]](*instr[1:])
        except (KeyError, IndexError, TypeError):
            raise AssertionError(f"unknown instruction {instr!r:.80}") from None
    return instr


# -- helpers the core and the transports share ----------------------------------------------
RETRY = object()  # a key the node could not bring into DRAM for this batch: the core retries it


def best_effort(method: str, request: Any) -> Op[None]:
    """Best-effort cleanup call; its failure must not mask the original error."""
    try:
        yield Rpc(method, request)
    except Exception:  # the error being raised already is the one the caller must see
        pass


def dest_view(meta: BlockMeta, out: memoryview | None) -> memoryview:
    """Where a block's payload goes: the caller's buffer (cut to size), or a new one."""
    if out is None:
        return memoryview(bytearray(meta.payload_len))
    if out.nbytes < meta.payload_len:
        raise InvalidArgument(f"output buffer holds {out.nbytes} bytes; block {meta.key.hex()} has {meta.payload_len}")
    return out[: meta.payload_len]
