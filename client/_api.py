"""The block calls every client offers the same way, over whichever core it drives.

``KVClient`` and ``ClusterClient`` (and their asyncio twins) differ in the core they run
(:class:`client._core.ClientCore` for one node, :class:`client._cluster.ClusterCore` for a
cluster) and in how they run its operations (``_run``); both cores answer ``put_many`` and
``get_many_into`` alike, so the calls built on them are written once here.  Owns no state.

``session_id=`` (session hints, ``kvstore/node/sessions.py``) names the caller's session on a put
or read; both cores carry it (``session=``; the cluster core to every node an operation calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.keys import Namespace


class BlockCalls:
    """put / get / exists for a blocking client with ``_core``, ``_run`` and ``lookup``."""

    _core: Any
    if TYPE_CHECKING:  # provided by the client class

        def _run(self, op: Any) -> Any: ...

        def lookup(self, keys: Sequence[bytes]) -> list[str | None]: ...

    def put(
        self,
        key: bytes,
        data: object,
        *,
        namespace: bytes | Namespace | None = None,
        parent: bytes | None = None,
        token_count: int = 0,
        session_id: str | None = None,
    ) -> bool:
        """Store one block; True if it is stored (or already was), False if the node had no room."""
        return self._run(
            self._core.put_many(
                [key],
                [data],
                namespace=namespace,
                parents=[parent],
                token_counts=[token_count],
                session=session_id,
            )
        )[0]

    def put_many(
        self,
        keys: Sequence[bytes],
        datas: Sequence[object],
        *,
        namespace: bytes | Namespace | None = None,
        parents: Sequence[bytes | None] | None = None,
        token_counts: Sequence[int] | None = None,
        session_id: str | None = None,
    ) -> list[bool]:
        return self._run(
            self._core.put_many(
                list(keys),
                list(datas),
                namespace=namespace,
                parents=parents,
                token_counts=token_counts,
                session=session_id,
            )
        )

    def get(self, key: bytes, *, session_id: str | None = None) -> bytes | None:
        return self._run(self._core.get_many_into([key], None, session=session_id))[0]

    def get_into(self, key: bytes, out: object, *, session_id: str | None = None) -> int | None:
        """Copy a block into ``out`` (bytes-like, numpy array or CPU tensor); bytes written, or None on a miss."""
        return self._run(self._core.get_many_into([key], [out], session=session_id))[0]

    def get_many(self, keys: Sequence[bytes], *, session_id: str | None = None) -> list[bytes | None]:
        return self._run(self._core.get_many_into(list(keys), None, session=session_id))

    def get_many_into(
        self, keys: Sequence[bytes], outs: Sequence[object], *, session_id: str | None = None
    ) -> list[int | None]:
        return self._run(self._core.get_many_into(list(keys), list(outs), session=session_id))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [t is not None for t in self.lookup(keys)]


class AsyncBlockCalls:
    """The asyncio twin of :class:`BlockCalls`."""

    _core: Any
    if TYPE_CHECKING:  # provided by the client class

        async def _run(self, op: Any) -> Any: ...

        async def lookup(self, keys: Sequence[bytes]) -> list[str | None]: ...

    async def put(
        self,
        key: bytes,
        data: object,
        *,
        namespace: bytes | Namespace | None = None,
        parent: bytes | None = None,
        token_count: int = 0,
        session_id: str | None = None,
    ) -> bool:
        return (
            await self._run(
                self._core.put_many(
                    [key],
                    [data],
                    namespace=namespace,
                    parents=[parent],
                    token_counts=[token_count],
                    session=session_id,
                )
            )
        )[0]

    async def put_many(
        self,
        keys: Sequence[bytes],
        datas: Sequence[object],
        *,
        namespace: bytes | Namespace | None = None,
        parents: Sequence[bytes | None] | None = None,
        token_counts: Sequence[int] | None = None,
        session_id: str | None = None,
    ) -> list[bool]:
        return await self._run(
            self._core.put_many(
                list(keys),
                list(datas),
                namespace=namespace,
                parents=parents,
                token_counts=token_counts,
                session=session_id,
            )
        )

    async def get(self, key: bytes, *, session_id: str | None = None) -> bytes | None:
        return (await self._run(self._core.get_many_into([key], None, session=session_id)))[0]

    async def get_into(self, key: bytes, out: object, *, session_id: str | None = None) -> int | None:
        return (await self._run(self._core.get_many_into([key], [out], session=session_id)))[0]

    async def get_many(self, keys: Sequence[bytes], *, session_id: str | None = None) -> list[bytes | None]:
        return await self._run(self._core.get_many_into(list(keys), None, session=session_id))

    async def get_many_into(
        self, keys: Sequence[bytes], outs: Sequence[object], *, session_id: str | None = None
    ) -> list[int | None]:
        return await self._run(self._core.get_many_into(list(keys), list(outs), session=session_id))

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [t is not None for t in await self.lookup(keys)]
