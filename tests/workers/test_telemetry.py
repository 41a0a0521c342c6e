"""The telemetry sender against a real HTTP server on loopback: batches in order, the bearer
token, a control plane that goes down and comes back (spool file, resent in order, nothing
lost), one that answers 503 for a while, a permanent 4xx, the spool picked up by the next
process of the same source, and the control plane's answer asking the job to stop."""

from __future__ import annotations

import json
import threading

from engine.launcher import free_port
from tests.waiting import wait_for
from tests.workers.telemetry_server import TelemetryServer
from workers.telemetry import TelemetrySender, telemetry_url


def sender(server: TelemetryServer, tmp_path, source="rank-0", **kw) -> TelemetrySender:
    return TelemetrySender(
        telemetry_url(server.api_url, "job-1"),
        "job-1",
        source,
        token=server.token,
        spool_dir=tmp_path / "spool",
        flush_interval_s=0.02,
        timeout_s=2,
        **kw,
    )


def iterations(server: TelemetryServer) -> list[int]:
    return [r["iteration"] for r in server.records("job-1")]


def test_records_and_events_arrive_in_order_with_the_token(tmp_path):
    server = TelemetryServer().start()
    try:
        with sender(server, tmp_path, event_defaults={"attempt": 0}) as s:
            for i in range(1, 201):
                s.record({"iteration": i, "loss": 1.0 / i})
            s.event("ranks_started", world_size=2)
            assert s.flush(30)
        assert iterations(server) == list(range(1, 201))
        (ev,) = server.events("job-1")
        assert ev["kind"] == "ranks_started" and ev["source"] == "rank-0" and ev["attempt"] == 0
        batch = server.batches[0]
        assert batch["version"] == 1 and batch["source"] == "rank-0" and "sent_at" in batch
        assert len({b["batch_id"] for b in server.batches}) == len(server.batches)
    finally:
        server.stop()
    assert not (tmp_path / "spool" / "job-1" / "rank-0.jsonl").exists()


def test_control_plane_down_then_back_nothing_lost_and_in_order(tmp_path):
    server = TelemetryServer(port=free_port())  # not started: connection refused
    spool = tmp_path / "spool" / "job-1" / "rank-0.jsonl"
    s = sender(server, tmp_path).start()
    try:
        for i in range(1, 51):
            s.record({"iteration": i})
        assert not s.flush(0.5)  # nobody answers
        assert spool.exists()  # kept on disk meanwhile
        on_disk = [json.loads(line) for line in spool.read_text().splitlines()]
        assert [r["iteration"] for b in on_disk for r in b["records"]] == list(range(1, 51))
        server.start()  # the control plane comes back, on the same address
        for i in range(51, 101):
            s.record({"iteration": i})
        assert s.flush(60)
        assert iterations(server) == list(range(1, 101))
        assert not spool.exists()
    finally:
        s.close(5)
        server.stop()


def test_unhealthy_answers_are_retried_and_a_permanent_refusal_is_dropped(tmp_path):
    server = TelemetryServer().start()
    try:
        server.status = 503
        s = sender(server, tmp_path).start()
        s.record({"iteration": 1})
        assert not s.flush(0.5)
        assert server.requests >= 1 and iterations(server) == []
        server.status = 200
        assert s.flush(60)
        assert iterations(server) == [1]
        server.status = 401  # a wrong token: re-sending cannot help
        s.record({"iteration": 2})
        assert s.flush(30)
        assert s.dropped_batches == 1 and iterations(server) == [1]
        s.close(5)
    finally:
        server.stop()


def test_the_spool_is_resent_first_by_the_next_process_of_the_same_source(tmp_path):
    server = TelemetryServer(port=free_port())
    first = sender(server, tmp_path).start()
    for i in range(1, 11):
        first.record({"iteration": i})
    assert not first.close(0.3)  # the rank dies with its telemetry undelivered
    server.start()
    try:
        second = sender(server, tmp_path).start()  # its restart, on the same machine
        for i in range(11, 21):
            second.record({"iteration": i})
        assert second.close(60)
        assert iterations(server) == list(range(1, 21))
    finally:
        server.stop()


def test_batches_stay_small_and_a_413_splits_them(tmp_path):
    server = TelemetryServer().start()
    try:
        s = sender(server, tmp_path, max_batch_bytes=1500)  # not started: one flush takes all
        pad = "x" * 200
        for i in range(1, 41):
            s.record({"iteration": i, "pad": pad})
        server.max_body = 1200  # smaller than the sender's own cap: it must split on 413
        assert s.flush(30)
        assert iterations(server) == list(range(1, 41))
        assert all(len(json.dumps(b)) < 1500 for b in server.batches)
        assert any(b["batch_id"].endswith(("a", "b")) for b in server.batches)
        s.close(5)
    finally:
        server.stop()


def test_a_422_drops_only_the_refused_record(tmp_path):
    """The API refuses a batch holding one out-of-bounds value (422): the sender halves the batch
    until the refused record stands alone, so the records sent with it still arrive."""
    server = TelemetryServer().start()
    try:
        s = sender(server, tmp_path)  # not started: one flush sends all 20 in one batch
        for i in range(1, 21):
            s.record({"iteration": i, **({"poison": True} if i == 7 else {})})
        server.refuse_key = "poison"
        assert s.flush(30)
        assert iterations(server) == [i for i in range(1, 21) if i != 7]
        s.close(5)
    finally:
        server.stop()


def test_record_never_waits_on_the_network(tmp_path):
    server = TelemetryServer()
    server.gate = threading.Event()  # the control plane accepts connections but never answers
    server.start()
    try:
        s = sender(server, tmp_path).start()
        s.record({"iteration": 0})
        wait_for(lambda: server.requests >= 1, 60, "the first POST")
        for i in range(1, 10001):  # the sender thread is stuck in a POST meanwhile
            s.record({"iteration": i})
        server.gate.set()
        assert s.flush(60)
        assert iterations(server) == list(range(0, 10001))
        s.close(5)
    finally:
        server.gate.set()
        server.stop()


def test_disabled_without_a_url(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTRON_API_URL", raising=False)
    s = TelemetrySender.from_env("job-1", "driver", spool_dir=tmp_path).start()
    s.record({"iteration": 1})
    assert s.event("x", a=1)["kind"] == "x"
    assert s.close(1) and not s.enabled and not any(tmp_path.iterdir())


def test_a_stop_in_the_answer_is_heard(tmp_path):
    """The scheduler's preemption reaches the ranks through the answers to their batches
    (RankHooks.should_stop is the sender's stop_requested)."""
    server = TelemetryServer().start()
    try:
        with sender(server, tmp_path) as s:
            s.record({"iteration": 1, "loss": 1.0})
            assert s.flush(30) and not s.stop_requested.is_set()
            server.ack = {"records_accepted": 1, "stop": "checkpoint"}
            s.record({"iteration": 2, "loss": 0.5})
            assert s.flush(30)
            assert s.stop_requested.is_set()
    finally:
        server.stop()
