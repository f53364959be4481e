"""Pinned-memory bookkeeping with a fake CUDA runtime: one process-wide, reference-counted
registration per range; a refused registration's error cleared at once; the mapping held
while registered, unregistered before it may go; a remapped arena registered anew and the
old one retired only after the copies queued from it (issue 18 #3, #4)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from gpu_agent_fakes import FakeCudart, mapped

from gpu_agent.pinned import ArenaPin, HostRegistry, buffer_address
from tiers.arena import Arena


class Fence:
    def __init__(self, done: bool = True) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture
def arena(tmp_path: Path) -> Any:
    owner = Arena.create(tmp_path / "a.arena", 1 << 20, prefault=False)
    yield owner
    owner.close()


def test_two_users_of_one_range_register_it_once(arena: Arena) -> None:
    rt = FakeCudart()
    reg = HostRegistry.shared(rt)
    assert HostRegistry.shared(rt) is reg  # one per runtime and process
    a, b = ArenaPin(reg, list), ArenaPin(reg, list)
    assert a.pin(arena.buf) and b.pin(arena.buf)  # a second cudaHostRegister would fail with 712
    ptr = buffer_address(arena.buf)[1]
    assert rt.count("register") == 1 and reg.refs(ptr) == 2
    assert a.pin(arena.buf) and rt.count("register") == 1  # the same mapping again: nothing to do
    a.close()
    assert ptr in rt.registered and rt.count("unregister") == 0
    b.close()
    assert rt.registered == {} and rt.count("unregister") == 1


def test_a_refused_registration_clears_the_error_and_is_not_pinned(arena: Arena) -> None:
    rt = FakeCudart(refuse=1)  # cudaErrorInvalidValue, as sandboxes that refuse host registration answer
    pin = ArenaPin(HostRegistry.shared(rt), list)
    assert pin.pin(arena.buf) is False and not pin.registered
    assert rt.last_error == 0, "the failed call's error was left for the next kernel launch to raise"
    ptr = buffer_address(arena.buf)[1]
    assert not pin.contains(ptr, 16)  # copies from it are staged, never DMA
    assert pin.pin(arena.buf) is False and rt.count("register") == 1  # not retried on every transfer
    pin.close()
    assert rt.count("unregister") == 0


def test_a_range_pinned_by_someone_else_is_used_but_never_unregistered(arena: Arena) -> None:
    rt = FakeCudart()
    ptr = buffer_address(arena.buf)[1]
    rt.registered[ptr] = arena.size  # registered outside this registry (another library)
    pin = ArenaPin(HostRegistry.shared(rt), list)
    assert pin.pin(arena.buf) is True and rt.last_error == 0
    pin.close()
    assert rt.count("unregister") == 0 and ptr in rt.registered


def test_contains_checks_the_whole_range(arena: Arena) -> None:
    pin = ArenaPin(HostRegistry.shared(FakeCudart()), list)
    pin.pin(arena.buf)
    ptr = buffer_address(arena.buf)[1]
    assert pin.contains(ptr, arena.size) and pin.contains(ptr + 100, 10)
    assert not pin.contains(ptr - 1, 10) and not pin.contains(ptr + arena.size - 5, 10)
    pin.close()
    assert not pin.contains(ptr, 1)


def test_the_registration_holds_the_mapping_until_it_is_unregistered(arena: Arena) -> None:
    rt = FakeCudart()
    client_side = Arena.attach(arena.path, arena.size)  # as a client maps it
    ptr = buffer_address(client_side.buf)[1]
    pin = ArenaPin(HostRegistry.shared(rt), list)
    assert pin.pin(client_side.buf)
    client_side.close()  # the client is closed first: the mapping must outlive the registration
    del client_side
    gc.collect()
    assert mapped(ptr), "the client unmapped memory that is still registered"
    pin.close()
    assert rt.mapped_at_unregister == [True]
    gc.collect()
    assert not mapped(ptr)  # and then it goes


def test_a_remapped_arena_is_registered_and_the_old_one_retired_after_its_copies(arena: Arena) -> None:
    rt = FakeCudart()
    fences: list[Fence] = []

    def fence() -> list[Fence]:
        fences.append(Fence(done=False))  # a copy queued before the switch, still running
        return fences[-1:]

    old = Arena.attach(arena.path, arena.size)
    old_ptr = buffer_address(old.buf)[1]
    pin = ArenaPin(HostRegistry.shared(rt), fence)
    assert pin.pin(old.buf)
    new = Arena.attach(arena.path, arena.size)  # the client remapped (a node restart)
    new_ptr = buffer_address(new.buf)[1]
    del old
    gc.collect()
    assert pin.pin(new.buf) and new_ptr in rt.registered
    assert pin.contains(new_ptr, 64) and not pin.contains(old_ptr, 64)
    assert old_ptr in rt.registered and pin.retired == 1  # a copy from it may still be in flight
    assert pin.reap() == 0 and mapped(old_ptr)
    fences[-1].done = True
    assert pin.reap() == 1 and old_ptr not in rt.registered and rt.mapped_at_unregister == [True]
    assert pin.stats()["pinned_registered_total"] == 2
    pin.close()
    new.close()
    assert rt.registered == {} and all(rt.mapped_at_unregister)
