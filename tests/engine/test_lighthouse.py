"""engine/fault_tolerance/lighthouse.py's liveness relay, with the real torchft Lighthouse.

- A linked process that is SIGKILLed stops being heartbeated as soon as its connection closes.
- A link that stays open but stops pinging (its host is gone) is dropped after the silent
  timeout, and not before.
- A live link stays, and the Lighthouse itself counts it as healthy: a quorum with it forms.
- Without the relay (torchft alone), a dead replica holds the quorum for the heartbeat timeout.
- The other way: a link whose Lighthouse process dies calls its `on_lost` at once; one closed
  by its own replica (the loop's end) does not.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from datetime import timedelta

from tests.tools import require_module

require_module("torchft", "torchft (a main dependency: pip install -e '.[dev]') is not installed")

from engine.fault_tolerance.lighthouse import RELAY_TIMEOUT_MS, Lighthouse, LivenessLink  # noqa: E402
from tests.waiting import wait_for  # noqa: E402


def _linked_until_killed(address: str, ready) -> None:
    LivenessLink(address, "doomed", interval_s=0.05)
    ready.set()
    time.sleep(600)


def _wait(predicate, timeout_s: float, what: str) -> float:
    """Seconds until `predicate` held (tests/waiting.py's poll)."""
    start = time.monotonic()
    wait_for(predicate, timeout_s, what, interval_s=0.01)
    return time.monotonic() - start


def test_a_killed_process_is_unlinked_at_once_and_a_silent_one_after_the_timeout():
    # A quorum waits this long for a replica that heartbeats but does not ask to join: the quorum
    # at the end forms only if the dead and the silent ones are out of the Lighthouse's view.
    lighthouse = Lighthouse(silent_timeout_ms=2000, join_timeout_ms=60_000)
    try:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        doomed = ctx.Process(target=_linked_until_killed, args=(lighthouse.liveness_address(), ready), daemon=True)
        doomed.start()
        assert ready.wait(60)
        alive = LivenessLink(lighthouse.liveness_address(), "alive", interval_s=0.05)
        # A host that vanished: the id, then nothing (no FIN reaches the relay).
        host, port = lighthouse.liveness_address().rsplit(":", 1)
        silent = socket.create_connection((host.strip("[]"), int(port)))
        silent.sendall(b"silent\n")
        silent_since = time.monotonic()
        _wait(lambda: set(lighthouse.linked()) == {"doomed", "alive", "silent"}, 10, "three links")

        os.kill(doomed.pid, signal.SIGKILL)
        gone_after = _wait(lambda: "doomed" not in lighthouse.linked(), 10, "the killed link dropped")
        assert gone_after < 1.0, f"the killed process stayed linked {gone_after:.2f} s (silent timeout 2 s)"
        assert {"alive", "silent"} <= set(lighthouse.linked())

        _wait(lambda: "silent" not in lighthouse.linked(), 10, "the silent link dropped")
        silent_for = time.monotonic() - silent_since
        assert 1.9 < silent_for < 5, f"a link silent for 2 s was dropped after {silent_for:.2f} s"
        assert lighthouse.linked() == ["alive"]

        time.sleep(3 * RELAY_TIMEOUT_MS / 1000)
        from torchft.coordination import LighthouseClient

        quorum = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5)).quorum(
            replica_id="alive", timeout=timedelta(seconds=5), address="a", store_address="s", step=0, world_size=1
        )
        assert [p.replica_id for p in quorum.participants] == ["alive"]
        alive.close()
        _wait(lambda: lighthouse.linked() == [], 5, "the closed link dropped")
        silent.close()
    finally:
        lighthouse.shutdown()


def test_without_the_relay_a_dead_replica_holds_the_quorum_for_the_heartbeat_timeout():
    """`relay=False` (bench/recovery.py's comparison): torchft's Lighthouse alone keeps counting a
    replica that stopped heartbeating until its heartbeat timeout, so the live one's quorum waits
    that long (two replicas: the split-brain rule needs more than half of those heartbeating)."""
    from torchft.coordination import LighthouseClient

    lighthouse = Lighthouse(silent_timeout_ms=1500, join_timeout_ms=60_000, relay=False)
    try:
        assert lighthouse.liveness_address() == "" and lighthouse.linked() == []
        client = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5))
        client.heartbeat("dead")  # its last heartbeat, then its process is gone
        stop = threading.Event()

        def heartbeat_alive() -> None:  # as its ManagerServer does
            beats = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5))
            while not stop.wait(0.1):
                beats.heartbeat("alive")

        beating = threading.Thread(target=heartbeat_alive, daemon=True)
        beating.start()
        started = time.monotonic()
        try:
            quorum = client.quorum(
                replica_id="alive", timeout=timedelta(seconds=10), address="a", store_address="s", step=0, world_size=1
            )
        finally:
            stop.set()
            beating.join(5)
        waited = time.monotonic() - started
        assert [p.replica_id for p in quorum.participants] == ["alive"]
        assert 1.2 < waited < 5, f"the quorum formed after {waited:.2f} s (heartbeat timeout 1.5 s)"
    finally:
        lighthouse.shutdown()


def _lighthouse_until_killed(queue) -> None:
    queue.put(Lighthouse().liveness_address())
    time.sleep(600)


def test_a_link_hears_its_lighthouse_die_and_a_closed_one_does_not():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    server = ctx.Process(target=_lighthouse_until_killed, args=(queue,), daemon=True)
    server.start()
    try:
        address = queue.get(timeout=60)
        lost, closed_lost = threading.Event(), threading.Event()
        LivenessLink(address, "replica", interval_s=0.05, on_lost=lost.set)
        closed = LivenessLink(address, "ended", interval_s=0.05, on_lost=closed_lost.set)
        time.sleep(0.3)
        assert not lost.is_set()  # a live Lighthouse is not lost
        closed.close()
        os.kill(server.pid, signal.SIGKILL)
        # Its kernel closes the relay's connections: the next ping finds the close.
        assert lost.wait(5)
        time.sleep(0.3)
        assert not closed_lost.is_set()
    finally:
        server.kill()
