"""A cluster client's sans-I/O core with no etcd behind it, for unit tests of routing.

``router(cluster)`` makes a :class:`client._cluster.ClusterCore` whose membership view is
fed by hand (``publish``) instead of by etcd; ``view`` builds the snapshots; ``drive`` runs
one of its operations, answering every :class:`client._cluster.Fanout` call itself.  The
core under test is the real one: only the cluster around it is described in values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from client._cluster import ClusterCore, Fanout
from kvstore.cluster.state import ClusterConfig, ClusterSnapshot, NodeInfo


@contextmanager
def router(cluster: str) -> Iterator[ClusterCore]:
    """A core for ``etcd://127.0.0.1:1/<cluster>`` (nothing listens there: the view is fed by hand)."""
    c = ClusterCore(
        f"etcd://127.0.0.1:1/{cluster}",
        timeouts=None,
        transport="tcp",
        verify=True,
        replication=None,
        suspect_s=30.0,
        prefer_local=False,
        wait_s=0,
    )
    try:
        yield c
    finally:
        c.close()


def view(
    cluster: str, revision: int, regs: dict[str, tuple[int, int]], replication: int = 2, port: int = 7000
) -> ClusterSnapshot:
    """A loaded view with nodes ``regs`` (node -> (record revision, lease)), addresses 10.0.0.x."""
    nodes = {n: NodeInfo(n, f"10.0.0.{i + 1}:{port}") for i, n in enumerate(sorted(regs))}
    return ClusterSnapshot(
        cluster, revision, nodes, ClusterConfig(replication=replication), {}, dict(regs), connected=True, loaded=True
    )


def publish(core: ClusterCore, snap: ClusterSnapshot) -> None:
    """Show ``core`` the membership ``snap``, as its etcd watch would."""
    core.membership._publish(snap)


def drive(op: Any, answer: Callable[[str, Any], Any]) -> tuple[Any, list[str]]:
    """Run a cluster operation, answering each fan-out call with ``answer(node, node_op)``;
    its result and the nodes called, in order."""
    calls: list[str] = []
    try:
        instr = next(op)
        while True:
            assert isinstance(instr, Fanout), instr
            calls.extend(node for node, _ in instr.calls)
            instr = op.send([answer(node, make) for node, make in instr.calls])
    except StopIteration as stop:
        return stop.value, calls
