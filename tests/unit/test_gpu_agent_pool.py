"""The HBM block pool (on CPU tensors here) and the copy engine's CPU streams and events."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gpu_agent.copy_engine import CopyEngine, DoneEvent, Segmented, copy_range, host_tensor
from gpu_agent.pool import HBMPool

K = [bytes([i]) * 16 for i in range(10)]
ROOT = Path(__file__).resolve().parents[2]


def test_capacity_is_whole_blocks_of_the_budget() -> None:
    p = HBMPool(1000, 300, torch.device("cpu"))
    assert p.capacity == 3 and p.free_slots == 3 and p.storage.numel() == 900
    assert HBMPool(100, 300, torch.device("cpu")).capacity == 0


def test_insert_lookup_and_lru_eviction() -> None:
    p = HBMPool(3 * 8, 8, torch.device("cpu"))
    slots = [p.insert(K[i], depth=i) for i in range(3)]
    assert all(s is not None and s.numel() == 8 for s in slots)
    assert len({s.data_ptr() for s in slots}) == 3  # distinct slots
    slots[0].fill_(7)
    assert p.lookup(K[0]) is not None and int(p.lookup(K[0])[0]) == 7  # touches K[0]
    s3 = p.insert(K[3], depth=0)  # full: evicts the LRU entry, K[1]
    assert s3 is not None and not p.contains(K[1]) and p.contains(K[0]) and p.evictions == 1
    assert s3.data_ptr() == slots[1].data_ptr()
    assert p.insert(K[3], depth=0).data_ptr() == s3.data_ptr()  # already resident: same slot


def test_protected_entries_are_never_evicted() -> None:
    p = HBMPool(2 * 8, 8, torch.device("cpu"))
    p.insert(K[0], 0)
    p.insert(K[1], 1)
    assert p.insert(K[2], 2, protect={K[0], K[1]}) is None
    assert p.insert(K[2], 2, protect={K[0]}) is not None and not p.contains(K[1])


def test_evict_and_clear_free_the_slots() -> None:
    p = HBMPool(2 * 8, 8, torch.device("cpu"))
    p.insert(K[0], 0)
    p.insert(K[1], 0)
    assert p.evict([K[0], K[5]]) == 1 and p.free_slots == 1
    p.clear()
    assert len(p) == 0 and p.free_slots == 2
    assert p.stats()["evictions"] == 2


def test_a_reserved_slot_is_invisible_until_published_and_free_again_if_given_back() -> None:
    """Issue 18 #5: prefetch published slots before its copy and lease check."""
    p = HBMPool(2 * 8, 8, torch.device("cpu"))
    i = p.reserve()
    assert i is not None and not p.contains(K[0]) and p.lookup(K[0]) is None and p.free_slots == 1
    assert p.stats()["reserved_slots"] == 1
    p.publish(K[0], i, depth=0)
    assert p.contains(K[0]) and p.stats()["reserved_slots"] == 0
    j = p.reserve()
    p.unreserve([j])
    assert p.free_slots == 1 and len(p) == 1


def test_a_held_slot_is_not_reused_until_released_even_if_evicted() -> None:
    p = HBMPool(2 * 8, 8, torch.device("cpu"))
    p.insert(K[0], 0)
    p.insert(K[1], 0)
    held = p.hold(K[0])
    assert held is not None
    p.lookup(K[1])  # K[0] is now the LRU entry, but a load reads it
    i = p.reserve()
    assert i is not None and i != held[0] and not p.contains(K[1])  # the unheld entry made room
    p.unreserve([i])
    assert p.evict([K[0]]) == 1 and not p.contains(K[0])  # gone from the map at once ...
    assert p.free_slots == 1 and held[0] not in (p.reserve(), p.reserve())  # ... its slot is not handed out
    p.release([held[0]])
    assert p.free_slots == 1 and p.stats()["held_slots"] == 0  # now it is


def test_segmented_pieces_span_extents() -> None:
    a, b, c = (
        torch.arange(0, 10, dtype=torch.uint8),
        torch.arange(10, 13, dtype=torch.uint8),
        torch.arange(13, 20, dtype=torch.uint8),
    )
    s = Segmented([a, b, c])
    assert s.nbytes == 20
    pieces = s.pieces(8, 7)
    assert [(rel, t.tolist()) for rel, t in pieces] == [(0, [8, 9]), (2, [10, 11, 12]), (5, [13, 14])]
    with pytest.raises(ValueError):
        s.pieces(15, 6)
    out = torch.zeros(20, dtype=torch.uint8)
    copy_range(out, 0, s, 0, 20)
    assert out.tolist() == list(range(20))
    dst = Segmented([torch.zeros(4, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)])
    copy_range(dst, 2, out, 10, 6)
    assert dst.parts[0].tolist() == [0, 0, 10, 11] and dst.parts[1][:4].tolist() == [12, 13, 14, 15]


def test_host_tensor_is_a_view_not_a_copy() -> None:
    buf = bytearray(16)
    t = host_tensor(memoryview(buf))
    t[3] = 9
    assert buf[3] == 9
    ro = host_tensor(memoryview(bytes(range(4))).toreadonly())  # leased arena blocks are read-only
    assert ro.tolist() == [0, 1, 2, 3]


def test_cpu_streams_run_in_order_and_events_complete() -> None:
    eng = CopyEngine(torch.device("cpu"))
    try:
        order: list[int] = []
        gate = threading.Event()
        e1 = eng.submit("h2d", lambda: (gate.wait(5), order.append(1)))
        e2 = eng.submit("h2d", lambda: order.append(2))
        assert not e1.query() and not e2.query()  # the caller does not block on submit
        gate.set()
        e2.synchronize()
        assert order == [1, 2] and e1.query()
        # a dependency across streams: d2h waits for an h2d event
        gate2 = threading.Event()
        e3 = eng.submit("h2d", lambda: (gate2.wait(5), order.append(3)))
        e4 = eng.submit("d2h", lambda: order.append(4), after=[e3])
        time.sleep(0.05)
        assert not e4.query()
        gate2.set()
        e4.wait()
        assert order == [1, 2, 3, 4]
        assert DoneEvent().query()
        bad = eng.submit("h2d", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.synchronize()
        assert eng.register_host(memoryview(bytearray(8))) is False  # nothing to pin without CUDA
    finally:
        eng.close()
    with pytest.raises(RuntimeError):
        eng.submit("h2d", lambda: None)


def test_gpu_agent_imports_without_torch_and_is_the_only_cuda_user() -> None:
    # `kvstore demo --help` imports kvstore.demo.cli, and the node must run without torch
    code = (
        "import sys, gpu_agent, kvstore.demo.cli, gpu_agent.layout, gpu_agent.prefetch; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
    offenders = [
        str(p.relative_to(ROOT))
        for d in ("kvstore", "client", "tiers")
        for p in (ROOT / d).rglob("*.py")
        if "torch.cuda" in p.read_text()
    ]
    # the product's one CUDA user is gpu_agent; its benchmark (a tool) times CUDA copies itself
    assert offenders == ["kvstore/bench/gpu.py"]
