"""``client._channel.Inflight``: the calls a blocking client starts without waiting (releases)
are made in order by a worker thread, waited for by ``drain``, dropped by ``stop``; the worker
ends once idle and another starts with the next call."""

from __future__ import annotations

import functools
import threading

import pytest

import client._channel as channel
from client._channel import Inflight


def test_calls_are_made_in_order_and_drained() -> None:
    done: list[int] = []
    gate = threading.Event()
    inflight = Inflight()
    inflight.add(lambda: gate.wait(10))
    for i in range(5):
        inflight.add(functools.partial(done.append, i))
    assert inflight  # pending while the first call is blocked
    gate.set()
    inflight.drain(10)
    assert done == [0, 1, 2, 3, 4] and not inflight


def test_a_failing_call_does_not_stop_the_rest() -> None:
    done: list[str] = []
    inflight = Inflight()

    def fail() -> None:
        raise RuntimeError("the node is gone")

    inflight.add(fail)
    inflight.add(lambda: done.append("after"))
    inflight.drain(10)
    assert done == ["after"]


def test_stop_drops_calls_not_started() -> None:
    done: list[int] = []
    gate = threading.Event()
    inflight = Inflight()
    inflight.add(lambda: gate.wait(10))
    inflight.add(lambda: done.append(1))
    inflight.stop()
    gate.set()
    inflight.drain(10)
    inflight.add(lambda: done.append(2))  # after stop: never made
    inflight.drain(1)
    assert done == [] and not inflight


def test_the_worker_ends_when_idle_and_another_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel, "_IDLE_S", 0.01)
    inflight = Inflight()
    names: list[threading.Thread] = []
    inflight.add(lambda: names.append(threading.current_thread()))
    inflight.drain(10)
    names[0].join(10)
    assert not names[0].is_alive()
    inflight.add(lambda: names.append(threading.current_thread()))
    inflight.drain(10)
    assert len(names) == 2 and names[1] is not names[0]
