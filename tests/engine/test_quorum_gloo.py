"""engine/fault_tolerance/quorum_gloo.py: the managed group's rendezvous has its own short timeout,
its collectives the full one. Two ranks in two processes meet through a store, as two replicas
do when a quorum changes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest

from tests.tools import require_module

require_module("torchft", "torchft (a main dependency: pip install -e '.[dev]') is not installed")

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

from engine.fault_tolerance.quorum_gloo import RENDEZVOUS_TIMEOUT_S, QuorumGloo  # noqa: E402

FULL = timedelta(seconds=4)
RENDEZVOUS = timedelta(seconds=0.3)


def _peer(store_addr: str, lag_s: float, ready=None) -> None:
    """Rank 1: (say it is about to) configure, wait `lag_s`, one all-reduce."""
    pg = QuorumGloo(FULL, RENDEZVOUS)
    if ready is not None:
        ready.set()
    pg.configure(store_addr, "peer", 1, 2)
    time.sleep(lag_s)
    pg.allreduce([torch.ones(4)], torch.distributed.ReduceOp.SUM).wait()


def _ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchft"])
    return ctx


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=FULL)


def test_a_peer_that_dies_during_the_rendezvous_costs_rendezvous_timeouts_not_step_timeouts(store):
    """The peer is killed at moments from before it reaches the store to after it connected.
    With one timeout for both (torchft's own group) gloo waited 5 x 4 s = 20 s where the kill
    landed inside its connect (measured: 25 s for 5 s); here each configure ends well within
    one full timeout, failing or not."""
    ctx = _ctx()
    took = {}
    for k, delay in enumerate(d / 100 for d in range(0, 16)):
        prefix = f"q{k}"
        peer = ctx.Process(target=_peer, args=(f"127.0.0.1:{store.port}/{prefix}", 60.0), daemon=True)
        peer.start()
        time.sleep(delay)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        started = time.monotonic()
        pg = QuorumGloo(FULL, RENDEZVOUS)
        try:
            pg.configure(f"127.0.0.1:{store.port}/{prefix}", "me", 0, 2)
            result = "configured"
        except RuntimeError as e:
            result = str(e).splitlines()[0][:60]
        took[delay] = (round(time.monotonic() - started, 2), result)
    slow = {d: t for d, t in took.items() if t[0] >= FULL.total_seconds()}
    assert not slow, f"configure waited a full timeout or more after the peer died: {slow} (all: {took})"


def test_the_collectives_keep_the_full_timeout(store):
    """A peer that reaches its all-reduce later than the rendezvous timeout, within the full one:
    the all-reduce completes (the rendezvous timeout must not become the collectives')."""
    ctx = _ctx()
    addr = f"127.0.0.1:{store.port}/lag"
    ready = ctx.Event()
    peer = ctx.Process(target=_peer, args=(addr, 3 * RENDEZVOUS.total_seconds(), ready), daemon=True)
    peer.start()
    try:
        # Both sides reach the rendezvous together, as a quorum's peers do: a peer process
        # still starting on a loaded machine would otherwise miss the 0.3 s rendezvous itself.
        assert ready.wait(30), "the peer process did not start"
        pg = QuorumGloo(FULL, RENDEZVOUS)
        pg.configure(addr, "me", 0, 2)
        t = torch.ones(4)
        pg.allreduce([t], torch.distributed.ReduceOp.SUM).wait()
        assert t.tolist() == [2.0] * 4
        peer.join(10)
        assert peer.exitcode == 0
    finally:
        if peer.is_alive():
            peer.kill()


def test_the_rendezvous_timeout_is_never_longer_than_the_full_one():
    short = timedelta(seconds=RENDEZVOUS_TIMEOUT_S / 2)
    assert QuorumGloo(short)._rendezvous_timeout == short
    assert QuorumGloo(timedelta(seconds=60))._rendezvous_timeout == timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
