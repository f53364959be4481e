"""Leaving the cluster is bounded: a node whose etcd calls hang still stops (its record then
expires with its lease), and a stop that fails never raises into the node's shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvstore.cluster.node import stop_quietly


class _Agent:
    """Stands in for NodeAgent.stop's behaviours against an etcd that misbehaves."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stopped = False
        self.cancels = 0

    async def stop(self) -> None:
        if self.mode == "fails":
            raise ConnectionError("etcd went away")
        if self.mode == "ignores-cancel":  # a call inside the etcd client that swallows one cancellation
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancels += 1
                    if self.cancels > 1:  # asyncio.run's own clean-up at the end of the test
                        raise
        self.stopped = True


def run(agent: Any, timeout: float) -> bool:
    return asyncio.run(stop_quietly(agent, timeout=timeout))


def test_a_stop_that_finishes_reports_so() -> None:
    agent = _Agent("ok")
    assert run(agent, 5.0) is True and agent.stopped


def test_a_failing_stop_does_not_raise() -> None:
    assert run(_Agent("fails"), 5.0) is True


@pytest.mark.timeout(30)
def test_a_stuck_stop_is_abandoned_after_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    agent = _Agent("ignores-cancel")
    with caplog.at_level(logging.WARNING, logger="kvstore.cluster.node"):
        assert run(agent, 0.2) is False
    assert agent.cancels >= 1 and not agent.stopped
    assert "expires with its lease" in caplog.text


def test_no_agent_is_a_finished_stop() -> None:
    assert run(None, 0.1) is True
