"""``kvstore bench sdk`` (and plain ``kvstore bench``): the SDK's data paths against
references measured in the same run.

Batched ``put_many`` / ``get_many_into`` of each size over the local (shared-memory), TCP
(data channel) and gRPC-stream paths, against memcpy, a raw loopback socket (``sendall``
→ ``recv_into``, peer in another process) and a private ``redis-server`` (spoken to in
RESP, replies read with ``recv_into``).  Without ``--target`` it runs its own node
process and stops it at the end.  ``--paths ...,tls`` adds a private TLS node's data
channel against a raw TLS socket (``kvstore.bench.tls``).

Method (``kvstore.bench.kit``): every buffer is allocated page-aligned and pre-faulted
before timing; each rep runs every case once, interleaved, so machine drift hits all of
them alike; the best rep counts.  Puts use new keys each rep (the node deduplicates puts
of stored keys) and are deleted afterwards, untimed.  The first get of each path is
checked byte for byte (by xxh3) against what was put.  Targets: architecture §15.

State: none beyond one run; owned by the calling thread.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvstore.bench import tls as benchtls
from kvstore.bench.kit import (
    REF_SIZE,
    TARGETS,
    Best,
    KiB,
    MiB,
    add_report_arguments,
    batched,
    blocks,
    buffer,
    each,
    label,
    log,
    print_targets,
    ratio,
    repeats,
    report,
    size_arg,
    sizes_arg,
    split_targets,
    timed,
)
from kvstore.bench.nodes import private_node
from kvstore.bench.refs import Redis, SocketPeer, memcpy
from kvstore.block import checksum
from kvstore.errors import KVStoreError, Unavailable
from kvstore.progress import Progress


class SDKPath:
    """One path (client) of the SDK; ``rep`` times one put and one get of the working set."""

    _run = itertools.count(int(time.time() * 1000) & 0xFFFFFFFF)

    def __init__(self, name: str, target: str, transport: str, **client_kw: Any) -> None:
        from client import KVClient

        self.name = name
        self.kv = KVClient(target, transport=transport, **client_kw)
        self.run = next(self._run) << 32 | os.getpid()
        self.seq = itertools.count()

    def rep(
        self, src: Sequence[np.ndarray], dst: Sequence[np.ndarray], batch: int, check: list[int] | None
    ) -> tuple[float, float]:
        tag = next(self.seq)
        keys = [struct.pack("<QII", self.run, tag, i) for i in range(len(src))]  # new keys: puts really write
        kb, sb, db = list(batched(keys, batch)), list(batched(src, batch)), list(batched(dst, batch))
        try:
            t_put = timed(lambda: each(lambda k, s: self._ok(self.kv.put_many(k, s), "put"), kb, sb))
            if check is not None:
                for d in dst:
                    d.fill(0)
            t_get = timed(lambda: each(lambda k, d: self._ok(self.kv.get_many_into(k, d), "get"), kb, db))
            if check is not None and [checksum(d) for d in dst] != check:
                raise KVStoreError(f"{self.name}: get returned bytes that differ from the put")
        finally:
            for k in batched(keys, 1024):
                self.kv.delete(k)
        return t_put, t_get

    def _ok(self, results: list[Any], what: str) -> None:
        if not all(results):
            raise KVStoreError(
                f"{self.name}: {results.count(False) + results.count(None)} of {len(results)} {what}s failed "
                "(node out of DRAM? give the node more --dram or a smaller --working-set)"
            )

    def close(self) -> None:
        self.kv.close()


def run_sdk(a: argparse.Namespace) -> dict[str, Any]:
    sizes, ws_goal, reps = a.sizes, a.working_set, a.repeat
    ref_size = REF_SIZE if REF_SIZE in sizes else sizes[len(sizes) // 2]
    ws_max = max(max(1, ws_goal // s) * s for s in sizes)
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    cleanup: list[Callable[[], object]] = [lambda: shutil.rmtree(work, ignore_errors=True)]
    out: dict[str, Any] = {
        "bench": "sdk",
        "working_set_bytes": ws_goal,
        "sizes": [label(s) for s in sizes],
        "repeat": reps,
        "batch_bytes": a.batch_bytes,
        "ref_size": label(ref_size),
    }
    try:
        log(f"sdk: buffers {2 * ws_max >> 20} MiB, raw-socket peer, redis ...")
        src_all, dst_all = buffer(ws_max, pattern=True), buffer(ws_max)
        peer = SocketPeer(ws_max)
        cleanup.append(peer.close)
        redis = None
        binary = shutil.which(a.redis_server) if a.redis_server else None
        if binary:
            try:
                redis = Redis(binary, work)
                cleanup.append(redis.close)
                out["redis"] = f"redis-server {redis.version}"
            except (Unavailable, OSError) as e:
                out["redis"] = f"not measured: {e}"
        else:
            out["redis"] = "not measured: redis-server not installed" if a.redis_server else "not measured: disabled"
        dram = -(-max(int(ws_max * 1.5), 4 * min(a.batch_bytes, ws_max), 64 * MiB) // MiB) * MiB
        if a.target:
            unix, tcp = split_targets(a.target)
            out["node"] = a.target
        else:
            log(f"sdk: starting a private node ({dram >> 20} MiB DRAM) ...")
            node = private_node(dram, work)
            cleanup.append(node.stop)
            unix, tcp = node.endpoints["unix"], node.endpoints["grpc"]
            out["node"] = f"private (pid {node.endpoints['pid']}, {dram >> 20} MiB DRAM)"
        paths: list[tuple[SDKPath, set[int]]] = []
        for name, target, transport, measured_at in (
            ("local", unix, "shm", set(sizes)),
            ("tcp", tcp, "data-channel", set(sizes)),
            ("grpc-stream", tcp or unix, "grpc-stream", set(a.stream_sizes)),
        ):
            if target and name in a.paths:
                p = SDKPath(name, target, transport)
                cleanup.append(p.close)
                paths.append((p, measured_at))
        tls = None
        if "tls" in a.paths:
            log(
                f"sdk: starting a private TLS node ({dram >> 20} MiB DRAM, throwaway certificates) and a TLS socket peer ..."
            )
            tls = benchtls.TLSBench(work, dram, ws_max)
            cleanup.extend([tls.close, (tls_path := SDKPath("tls", tls.target, "data-channel", **tls.client_kw)).close])
            paths.append((tls_path, set(sizes)))
        results: dict[str, dict[str, Any]] = {p.name: {} for p, _ in paths}
        refs: dict[str, dict[str, Any]] = {}
        prog = Progress("kvstore bench", total=len(sizes) * reps, unit="rounds")
        cleanup.append(prog.close)
        for size in sizes:
            n = max(1, ws_goal // size)
            ws, batch = n * size, max(1, a.batch_bytes // size)
            src, dst = blocks(src_all, size)[:n], blocks(dst_all, size)[:n]
            check = [checksum(s) for s in src]
            prog.step(f"{n} x {label(size)} in batches of {batch}")
            here = [p for p, at in paths if size in at]
            best = {
                k: Best()
                for k in [
                    "memcpy",
                    "socket_get",
                    "socket_put",
                    "redis_put",
                    "redis_get",
                    "tls_socket_get",
                    "tls_socket_put",
                ]
                + [f"{p.name}_{op}" for p in here for op in ("put", "get")]
            }
            for rep in range(reps):
                best["memcpy"].add(timed(lambda: memcpy(src, dst)))  # noqa: B023 - timed() calls it at once
                best["socket_put"].add(timed(lambda: peer.put(src)))  # noqa: B023 - timed() calls it at once
                best["socket_get"].add(timed(lambda: peer.get(dst)))  # noqa: B023 - timed() calls it at once
                if tls is not None:
                    best["tls_socket_put"].add(timed(lambda: tls.peer.put(src)))  # noqa: B023 - timed() calls it at once
                    best["tls_socket_get"].add(timed(lambda: tls.peer.get(dst)))  # noqa: B023 - timed() calls it at once
                if redis is not None:
                    rkeys = [b"bench:%d:%d" % (rep, i) for i in range(n)]
                    best["redis_put"].add(
                        timed(
                            lambda: each(redis.set_many, batched(rkeys, batch), batched(src, batch))  # noqa: B023 - timed() calls it at once
                        )
                    )
                    best["redis_get"].add(
                        timed(
                            lambda: each(redis.get_many_into, batched(rkeys, batch), batched(dst, batch))  # noqa: B023 - timed() calls it at once
                        )
                    )
                    redis.command(b"FLUSHALL")
                for p in here:
                    tp, tg = p.rep(src, dst, batch, check if rep == 0 else None)
                    best[f"{p.name}_put"].add(tp)
                    best[f"{p.name}_get"].add(tg)
                prog.update()
            refs[label(size)] = {
                "memcpy_gbps": best["memcpy"].gbps(ws),
                "socket_gbps": best["socket_get"].gbps(ws),
                "socket_put_gbps": best["socket_put"].gbps(ws),
                "redis_put_gbps": best["redis_put"].gbps(ws),
                "redis_get_gbps": best["redis_get"].gbps(ws),
                "blocks": n,
                "batch": batch,
                "tls_socket_gbps": best["tls_socket_get"].gbps(ws),
                "tls_socket_put_gbps": best["tls_socket_put"].gbps(ws),
            }
            for p in here:
                results[p.name][label(size)] = {
                    "put_gbps": best[f"{p.name}_put"].gbps(ws),
                    "get_gbps": best[f"{p.name}_get"].gbps(ws),
                    "blocks": n,
                    "batch": batch,
                }
        if tls is not None:
            out["tls"] = {"cipher": tls.sdk_cipher(tls_path.kv), "socket_cipher": tls.socket_cipher, "node": tls.target}
    finally:
        for fn in reversed(cleanup):
            with contextlib.suppress(Exception):
                fn()
    out["paths"] = results
    out["references"] = refs
    r = refs[label(ref_size)]
    out.update({k: r[k] for k in ("memcpy_gbps", "socket_gbps", "socket_put_gbps", "redis_put_gbps", "redis_get_gbps")})

    def at(path: str, key: str) -> Any:
        return results.get(path, {}).get(label(ref_size), {}).get(key)

    out["ratios"] = {
        "local_get_vs_memcpy": ratio(at("local", "get_gbps"), r["memcpy_gbps"]),
        "local_put_vs_memcpy": ratio(at("local", "put_gbps"), r["memcpy_gbps"]),
        "tcp_get_vs_socket": ratio(at("tcp", "get_gbps"), r["socket_gbps"]),
        "tcp_get_vs_redis": ratio(at("tcp", "get_gbps"), r["redis_get_gbps"]),
        "tcp_put_vs_socket": ratio(at("tcp", "put_gbps"), r["socket_put_gbps"]),
        "tcp_put_vs_redis": ratio(at("tcp", "put_gbps"), r["redis_put_gbps"]),
    }
    if "tls" in results:  # reported, not targeted: architecture §15 sets no TLS figure
        out["ratios"].update(benchtls.ratios(at, r))
    out["targets"] = {
        k: TARGETS[k] for k in ("local_get_vs_memcpy", "local_put_vs_memcpy", "tcp_get_vs_socket", "tcp_get_vs_redis")
    }
    out["targets_met"] = {
        k: (None if out["ratios"][k] is None else out["ratios"][k] >= t) for k, t in out["targets"].items()
    }
    return out


def print_sdk(r: dict[str, Any], f: TextIO) -> None:
    print(
        f"kvstore bench: working set {label(r['working_set_bytes'])}, batches of <= {label(r['batch_bytes'])}, "
        f"best of {r['repeat']}; node: {r['node']}; redis: {r['redis']}",
        file=f,
    )
    print(
        f"{'path':<13}{'size':>8}{'put GB/s':>10}{'get GB/s':>10}{'put/memcpy':>12}{'get/memcpy':>12}{'get/socket':>12}",
        file=f,
    )
    for path, by_size in r["paths"].items():
        for size, v in by_size.items():
            ref = r["references"][size]
            rel = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
            sock = ref.get("tls_socket_gbps") if path == "tls" else ref["socket_gbps"]  # TLS against the TLS socket
            print(
                f"{path:<13}{size:>8}{v['put_gbps']:>10.2f}{v['get_gbps']:>10.2f}{rel(v['put_gbps'], ref['memcpy_gbps']):>12}"
                f"{rel(v['get_gbps'], ref['memcpy_gbps']):>12}{rel(v['get_gbps'], sock):>12}",
                file=f,
            )
    print(
        f"{'reference':<13}{'size':>8}{'memcpy':>10}{'sock put':>10}{'sock get':>10}{'redis put':>11}{'redis get':>11}",
        file=f,
    )
    for size, ref in r["references"].items():
        fmt = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
        print(
            f"{'':<13}{size:>8}{fmt(ref['memcpy_gbps']):>10}{fmt(ref['socket_put_gbps']):>10}{fmt(ref['socket_gbps']):>10}"
            f"{fmt(ref['redis_put_gbps']):>11}{fmt(ref['redis_get_gbps']):>11}",
            file=f,
        )
        if ref.get("tls_socket_gbps"):
            print(
                f"{'TLS socket':<13}{size:>8}{'':>10}{fmt(ref['tls_socket_put_gbps']):>10}{fmt(ref['tls_socket_gbps']):>10}",
                file=f,
            )
    if r.get("tls"):
        benchtls.print_summary(r, f)
    print(f"targets at {r['ref_size']} (architecture §15):", file=f)
    print_targets(r, f)


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """``--target`` and ``--paths``: shared with ``kvstore bench latency``."""
    p.add_argument(
        "--target",
        default=None,
        metavar="T[,T]",
        help="use this node: unix:///sock (local path), host:port (tcp), or both comma-separated; default: start a private node",
    )
    p.add_argument(
        "--paths",
        default="local,tcp,grpc-stream",
        help="paths to measure (default local,tcp,grpc-stream); add 'tls' for the TLS data channel of a private TLS node "
        "against a raw TLS socket (needs the cryptography package)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_arguments(p, quick="32MiB working set, 4MiB blocks, 2 reps", rep="reps per case")
    p.add_argument(
        "--working-set",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="bytes moved per size and rep (default 256MiB)",
    )
    p.add_argument(
        "--batch-bytes", type=size_arg, default=64 * MiB, metavar="SIZE", help="bytes per batched call (default 64MiB)"
    )
    p.add_argument(
        "--sizes", type=sizes_arg, default=None, metavar="LIST", help="block sizes (default 256KiB,4MiB,32MiB)"
    )
    add_target_arguments(p)
    p.add_argument(
        "--stream-sizes",
        type=sizes_arg,
        default=[4 * MiB],
        metavar="LIST",
        help="sizes at which to measure the slow grpc-stream fallback (default 4MiB)",
    )
    p.add_argument(
        "--redis-server", default="redis-server", metavar="PATH", help="redis-server binary ('' to skip Redis)"
    )


def main(a: argparse.Namespace) -> int:
    repeats(a)
    a.working_set = a.working_set or (32 * MiB if a.quick else 256 * MiB)
    a.sizes = a.sizes or ([4 * MiB] if a.quick else [256 * KiB, 4 * MiB, 32 * MiB])
    a.paths = {x.strip() for x in a.paths.split(",") if x.strip()}
    load_before = os.getloadavg()[0]
    result = run_sdk(a)
    return report(result, json_out=a.json, load_before=load_before, table=lambda f: print_sdk(result, f))
