"""Private networks for fault tests: network namespaces joined to the root namespace by
veth pairs, and partitions that drop packets silently.

One :class:`Network` per test owns everything it creates (namespaces and the veth pairs
inside them) and deletes it in :meth:`Network.close`, also after a failure.  Names carry
the creating PID and a random token, so parallel runs never collide, and a new network
first deletes namespaces whose creator is gone (an aborted run).  Deleting a namespace
destroys its veth pair, so a namespace is the only thing that can leak.

Layout (a ``10.200.X.0/24`` no other network on the machine uses, one ``/28`` per host,
host ``i`` at ``b = 16 * i``)::

    root namespace (etcd, the test, its clients)        namespace of host i (a node)
      veth end   10.200.X.b+1/28  ------------------------  veth end   10.200.X.b+2/28  data address (advertised)
                                                                       10.200.X.b+3/28  control address (to etcd)
      anchor     10.200.X.1/32 (etcd listens here; the      route 10.200.X.1/32 via b+14 src b+3
                 root end of a pair to an empty namespace)

Every neighbour entry is static (``nud permanent``), one per direction of each path:
clients ↔ node is ``root: b+2`` and ``node: b+1``; etcd ↔ node is ``root: b+3`` and
``node: b+14`` (a gateway alias that only the etcd route uses).  A partition rewrites the
entries of a path to a MAC address nobody has, so frames still leave but the receiving
veth discards them as addressed to another host: packets vanish without an ICMP error or
a reset, as behind a failed switch, and connections hang until their deadlines, unlike
a killed process whose port refuses.  Healing restores the real MAC addresses.

Needs root and iproute2 (``scripts/setup.sh`` installs it).  No ``ip_forward``, iptables,
tc or dummy interfaces: nothing outside the network's own links changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import uuid

NOWHERE = "02:00:5e:00:53:00"  # locally administered; on no interface
PREFIX = "kvt"  # namespace names: kvt-<pid>-<token>-<host>
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-")


class NetError(RuntimeError):
    pass


def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()} (rc={r.returncode})")
    return r.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 is not installed (`ip` is missing): run scripts/setup.sh or apt-get install iproute2"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace and its link to the root namespace."""

    name: str
    ns: str
    root_if: str
    ns_if: str
    gateway: str  # root end: the address clients in the root namespace come from
    ip: str  # the host's data address: what a node there advertises
    control_ip: str  # the host's source address towards etcd
    etcd_gateway: str  # alias next hop of the etcd route inside the namespace
    root_mac: str
    ns_mac: str

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """Prefix of a command line that runs in this namespace."""
        return ("ip", "netns", "exec", self.ns)


def _mac(ifname: str, ns: str | None = None) -> str:
    (link,) = json.loads(ip("-j", "link", "show", "dev", ifname, ns=ns))
    return str(link["address"])


def _subnets_in_use() -> set[int]:
    """Third octets of 10.200.X.0/24 networks this machine already uses."""
    text = ip("-4", "-o", "addr", "show") + ip("-4", "route", "show", "table", "all")
    return {int(m) for m in re.findall(r"\b10\.200\.(\d+)\.", text)}


def sweep_orphans() -> list[str]:
    """Delete namespaces left by runs whose process is gone; returns their names."""
    gone = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its run is alive (maybe a parallel one): leave it alone
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        # its nodes outlived it (nobody reads their output or will stop them); while they
        # run, the namespace and its links would stay
        for pid in ip("netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", name, check=False)
        gone.append(name)
    return gone


class Network:
    """A private network of namespaces; see the module docstring for the layout."""

    def __init__(self) -> None:
        why = unavailable_reason()
        if why is not None:
            raise NetError(why)
        self.token = uuid.uuid4().hex[:5]
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._anchor: Host | None = None
        # under a lock, so that a parallel run sees this network's address before it picks its own
        with open(
            "/run/lock/kvstore-test-netns.lock" if os.path.isdir("/run/lock") else "/tmp/kvstore-test-netns.lock", "w"
        ) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep_orphans()
            used = _subnets_in_use()
            free = [x for x in range(1, 255) if x not in used]
            if not free:
                raise NetError("every 10.200.X.0/24 is in use on this machine")
            self.net = ipaddress.ip_network(f"10.200.{random.choice(free)}.0/24")
            try:
                self._anchor = self._link("etcd", 0)  # the root end holds etcd's address
                ip("addr", "add", f"{self.etcd_host}/32", "dev", self._anchor.root_if)
            except BaseException:
                self.close()
                raise

    def _addr(self, n: int) -> str:
        return str(self.net.network_address + n)

    @property
    def etcd_host(self) -> str:
        """The address etcd should listen on, in the root namespace; every host routes to it."""
        return self._addr(1)

    def _link(self, name: str, index: int) -> Host:
        """A namespace and a veth pair; host ``index`` gets the /28 at ``16 * index``."""
        ns = f"{PREFIX}-{os.getpid()}-{self.token}-{name}"
        root_if, ns_if = f"kv{self.token}r{index}", f"kv{self.token}n{index}"
        ip("netns", "add", ns)
        self._namespaces.append(ns)
        ip("link", "add", root_if, "type", "veth", "peer", "name", ns_if, "netns", ns)
        ip("link", "set", "lo", "up", ns=ns)
        base = 16 * index
        h = Host(
            name,
            ns,
            root_if,
            ns_if,
            gateway=self._addr(base + 1),
            ip=self._addr(base + 2),
            control_ip=self._addr(base + 3),
            etcd_gateway=self._addr(base + 14),
            root_mac=_mac(root_if),
            ns_mac=_mac(ns_if, ns),
        )
        ip("link", "set", root_if, "up")
        ip("link", "set", ns_if, "up", ns=ns)
        return h

    def add_host(self, name: str) -> Host:
        """A namespace for ``name``, reachable from the root namespace at ``host.ip``, with a route to etcd."""
        if name in self.hosts:
            raise NetError(f"host {name!r} exists")
        index = len(self.hosts) + 1
        if index > 14:
            raise NetError("at most 14 hosts per network")
        etcd = self.etcd_host
        h = self._link(name, index)
        ip("addr", "add", f"{h.gateway}/28", "dev", h.root_if)
        ip("addr", "add", f"{h.ip}/28", "dev", h.ns_if, ns=h.ns)
        ip("addr", "add", f"{h.control_ip}/28", "dev", h.ns_if, ns=h.ns)
        self.hosts[name] = h
        self._set(h, clients=True, etcd=True, up=True)
        ip("route", "add", f"{etcd}/32", "via", h.etcd_gateway, "dev", h.ns_if, "src", h.control_ip, ns=h.ns)
        return h

    def _set(self, h: Host, *, clients: bool, etcd: bool, up: bool) -> None:
        root_mac, ns_mac = (h.root_mac, h.ns_mac) if up else (NOWHERE, NOWHERE)
        entries = []
        if clients:
            entries += [(None, h.ip, ns_mac, h.root_if), (h.ns, h.gateway, root_mac, h.ns_if)]
        if etcd:
            entries += [(None, h.control_ip, ns_mac, h.root_if), (h.ns, h.etcd_gateway, root_mac, h.ns_if)]
        for ns, addr, mac, dev in entries:
            ip("neigh", "replace", addr, "lladdr", mac, "dev", dev, "nud", "permanent", ns=ns)

    def cut(self, name: str, *, clients: bool = True, etcd: bool = True) -> None:
        """Partition host ``name`` from the root namespace's clients, from etcd, or (default) both."""
        self._set(self.hosts[name], clients=clients, etcd=etcd, up=False)

    def heal(self, name: str) -> None:
        self._set(self.hosts[name], clients=True, etcd=True, up=True)

    def heal_all(self) -> None:
        for name in self.hosts:
            self.heal(name)

    def close(self) -> None:
        """Delete every namespace (and with it every veth pair) this network made."""
        errors = []
        for h in [*self.hosts.values(), *([self._anchor] if self._anchor else [])]:
            ip("link", "del", h.root_if, check=False)  # the pair goes even if a process keeps the namespace
        for ns in reversed(self._namespaces):
            try:
                ip("netns", "del", ns)
            except NetError as e:
                errors.append(str(e))
        self._namespaces.clear()
        self.hosts.clear()
        self._anchor = None
        if errors:
            raise NetError("; ".join(errors))


def probe(host: str, port: int, timeout: float = 0.5) -> str:
    """``"open"``, ``"refused"``, ``"timeout"`` (silently dropped) or another error's name."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return type(e).__name__
