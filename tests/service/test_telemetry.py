"""Telemetry ingestion (service/METRICS.md): at-least-once delivery, restarts, events, and what it
feeds: the job's iteration, metrics, events, checkpoints, state, and the Prometheus series."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.test_api_jobs import TINY
from tests.service.test_attack_surfaces import scrape

METRICS_MD = Path(__file__).resolve().parents[2] / "service" / "METRICS.md"


def rec(i: int, **extra) -> dict:
    return {
        "iteration": i,
        "loss": 5.0 - i / 10,
        "lr": 0.001,
        "grad_norm": 1.5,
        "tokens": 1000,
        "step_time_s": 0.2,
        "tokens_per_s": 5000.0,
        "mfu": 0.05,
        "loss_scale": 1.0,
        "skipped": False,
        "energy_j": 2.5,
        "power_w": 12.5,
        **extra,
    }


@pytest.fixture
def running(env):
    """A launched job and a client holding its job token."""
    with env.client() as c:
        job_id = c.post("/v1/jobs", json={**TINY, "training": {"train_iters": 10}}).json()["id"]
    env.wait_state(job_id, "starting")
    worker = env.client(token=env.launcher.env_of(job_id)["ELASTRON_API_TOKEN"])
    yield job_id, worker
    worker.close()


def post(worker, job_id, records=(), events=()):
    r = worker.post(
        f"/v1/internal/jobs/{job_id}/telemetry", json={"records": list(records), "events": list(events)}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_first_record_makes_the_job_running_and_redelivery_is_ignored(env, running):
    job_id, worker = running
    ack = post(worker, job_id, [rec(1), rec(2)])
    assert ack["records_accepted"] == 2 and ack["state"] == "running"
    ack = post(worker, job_id, [rec(2), rec(3)])  # at-least-once: iteration 2 again
    assert (ack["records_accepted"], ack["records_ignored"]) == (1, 1)
    job = env.job(job_id)
    assert job["state"] == "running" and job["iteration"] == 3 and job["started_at"]
    assert job["last_metrics"]["iteration"] == 3 and job["last_metrics"]["loss"] == pytest.approx(4.7)
    with env.client() as c:
        page = c.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 2}).json()
        assert [r["iteration"] for r in page["records"]] == [1, 2] and page["next_after"] == 2
        page = c.get(f"/v1/jobs/{job_id}/metrics", params={"after": 2}).json()
        assert [r["iteration"] for r in page["records"]] == [3] and page["next_after"] is None
        assert page["records"][0] == rec(3)  # stored as sent


def test_records_after_a_restart_replace_the_redone_iterations(env, running):
    job_id, worker = running
    post(worker, job_id, [rec(i) for i in range(1, 7)])
    restart = {"kind": "restart", "cause": "node_lost", "ts": 1000.0, "iteration": 6, "resumed_from": 4}
    ack = post(worker, job_id, events=[restart])
    assert ack["state"] == "restarting"
    assert post(worker, job_id, events=[restart])["events_duplicate"] == 1  # counted once
    ack = post(worker, job_id, [rec(5, loss=9.0), rec(6, loss=9.5)])
    assert ack["records_replaced"] == 2 and ack["state"] == "running"
    job = env.job(job_id)
    assert job["restarts"] == 1 and job["iteration"] == 6 and job["last_metrics"]["loss"] == 9.5
    ack = post(worker, job_id, [rec(5, loss=1.0)])  # a redelivery within the new run: ignored
    assert ack["records_ignored"] == 1
    with env.client() as c:
        losses = {r["iteration"]: r["loss"] for r in c.get(f"/v1/jobs/{job_id}/metrics").json()["records"]}
        events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
    assert losses[5] == 9.0 and losses[4] == pytest.approx(4.6)
    assert [e["data"].get("to") for e in events if e["kind"] == "state"][-2:] == ["restarting", "running"]
    (ev,) = [e for e in events if e["kind"] == "restart"]
    assert ev["message"] == "worker group restart: node_lost" and ev["data"]["resumed_from"] == 4


def test_records_carrying_attempt_keep_the_newest_run(env, running):
    """The workers tag records with `attempt`: a redone iteration from a later attempt replaces the
    stored one, an older attempt's late redelivery never does."""
    job_id, worker = running
    post(worker, job_id, [rec(i, attempt=0) for i in range(1, 5)])
    ack = post(
        worker,
        job_id,
        events=[{"kind": "restart", "attempt": 1, "cause": "died", "reason": "rank 1 died", "ts": 5.0}],
    )
    assert ack["state"] == "restarting"
    ack = post(worker, job_id, [rec(3, attempt=1, loss=7.0), rec(4, attempt=0, loss=8.0)])
    assert (ack["records_replaced"], ack["records_ignored"]) == (1, 1)
    job = env.job(job_id)
    assert job["iteration"] == 3 and job["last_metrics"]["attempt"] == 1 and job["state"] == "running"
    assert job["restarts"] == 1
    with env.client() as c:
        losses = {r["iteration"]: r["loss"] for r in c.get(f"/v1/jobs/{job_id}/metrics").json()["records"]}
    assert losses[3] == 7.0 and losses[4] == pytest.approx(4.6)


def test_an_elastic_resize_replaces_redone_records_by_group(env, running):
    """A resize starts a new worker group inside the same attempt (no restart event): the redone
    iterations from the newer group replace the stored ones; a late one from the old group does
    not; the restart counter does not move."""
    job_id, worker = running
    post(worker, job_id, [rec(i, attempt=0, group=0) for i in range(1, 5)])
    ack = post(worker, job_id, [rec(3, attempt=0, group=1, loss=7.0), rec(4, attempt=0, group=0, loss=8.0)])
    assert (ack["records_replaced"], ack["records_ignored"]) == (1, 1)
    job = env.job(job_id)
    assert job["iteration"] == 3 and job["last_metrics"]["group"] == 1 and job["restarts"] == 0
    with env.client() as c:
        losses = {r["iteration"]: r["loss"] for r in c.get(f"/v1/jobs/{job_id}/metrics").json()["records"]}
    assert losses[3] == 7.0 and losses[4] == pytest.approx(4.6)


def test_checkpoint_and_rerun_events(env, running):
    job_id, worker = running
    saved = {
        "kind": "checkpoint_saved",
        "iteration": 5,
        "rank": 0,
        "host": "n1",
        "seconds": 1.5,
        "bytes": 123456,
        "uri": "s3://b/ckpt/tiny/iter_0000005",
        "ts": 2000.0,
    }
    post(
        worker,
        job_id,
        [rec(5)],
        [
            {
                "kind": "diagnosis",
                "diagnosis": "transient_error",
                "iteration": 3,
                "rank": 1,
                "host": "n2",
                "ts": 1.0,
            },
            saved,
            {"kind": "checkpoint_failed", "iteration": 4, "error": "disk full", "ts": 3.0},
            {"kind": "rerun_in_place", "iteration": 3, "rank": 0, "ts": 0.5},
        ],
    )
    post(worker, job_id, events=[saved])  # redelivered: one checkpoint
    job = env.job(job_id)
    assert job["latest_checkpoint"]["uri"] == saved["uri"] and job["latest_checkpoint"]["iteration"] == 5
    with env.client() as c:
        ckpts = c.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
        kinds = [e["kind"] for e in c.get(f"/v1/jobs/{job_id}/events").json()["events"]]
        diag = c.get(f"/v1/jobs/{job_id}/events", params={"kind": "diagnosis"}).json()["events"]
    assert [(x["result"], x["iteration"]) for x in ckpts] == [("success", 5), ("failure", 4)]
    assert kinds.count("checkpoint_saved") == 1 and "rerun_in_place" in kinds
    assert diag[0]["data"]["diagnosis"] == "transient_error" and diag[0]["data"]["host"] == "n2"


def test_non_finite_numbers_are_stored_as_null(env, running):
    job_id, worker = running
    body = '{"records": [{"iteration": 1, "loss": NaN, "grad_norm": Infinity, "tokens": 10}], "events": []}'
    r = worker.post(
        f"/v1/internal/jobs/{job_id}/telemetry", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    last = env.job(job_id)["last_metrics"]
    assert last["loss"] is None and last["grad_norm"] is None and last["tokens"] == 10
    with env.client() as c:
        assert c.get(f"/v1/jobs/{job_id}/metrics").json()["records"][0]["loss"] is None
    assert ("elastron_job_loss", frozenset()) not in samples(scrape(env), job_id)


def test_bad_batches_are_422(env, running):
    job_id, worker = running
    for body in (
        {"records": [{"loss": 1.0}]},
        {"records": [{"iteration": -1}]},
        {"events": [{"iteration": 1}]},
        {"records": "x"},
        {"records": [{"iteration": 1, "tokens": "many"}]},
    ):
        r = worker.post(f"/v1/internal/jobs/{job_id}/telemetry", json=body)
        assert r.status_code == 422, body
    assert env.job(job_id)["iteration"] is None


def samples(text: str, job_id: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels other than job and tenant): value} of one job's series."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("job") == job_id:
                assert sample.labels["tenant"] == "alice"
                rest = frozenset((k, v) for k, v in sample.labels.items() if k not in ("job", "tenant"))
                out[(sample.name, rest)] = sample.value
    return out


def test_metrics_endpoint_shows_the_jobs_series(env, running):
    job_id, worker = running
    post(
        worker,
        job_id,
        [
            rec(1),
            rec(2, timers={"forward": [0.1, 0.12], "optimizer": [0.01, 0.02]}),
            rec(3, valid_loss=3.3, skipped=True, step_time_s=7.0),
        ],
        [
            {"kind": "restart", "cause": "worker_died", "ts": 1.0},
            {
                "kind": "recovered",
                "recovered_from": "memory",
                "steps_lost": 1,
                "iteration": 2,
                "phase_seconds": {"group_start": 1.5, "restore": 0.02},
                "ts": 1.5,
            },
            {"kind": "diagnosis", "diagnosis": "correct_result", "ts": 2.0},
            {
                "kind": "checkpoint_saved",
                "iteration": 3,
                "seconds": 2.0,
                "bytes": 5000,
                "uri": "/c/iter_0000003",
                "retries": 2,
                "ts": 3.0,
            },
        ],
    )
    with env.client("admin") as c:  # /metrics needs a scrape or admin token (ELASTRON_METRICS_TOKEN)
        text = c.get("/metrics").text
    got = samples(text, job_id)

    def one(name: str, **labels: str) -> float:
        return got[(name, frozenset(labels.items()))]

    assert one("elastron_job_iteration") == 3
    assert one("elastron_job_train_iterations") == 10
    assert one("elastron_job_loss") == pytest.approx(4.7)
    assert one("elastron_job_validation_loss") == pytest.approx(3.3)
    assert one("elastron_job_tokens_total") == 3000
    assert one("elastron_job_skipped_iterations_total") == 1
    assert one("elastron_job_energy_joules_total") == pytest.approx(7.5)
    assert one("elastron_job_power_watts") == pytest.approx(12.5)
    assert one("elastron_job_mfu_ratio") == pytest.approx(0.05)
    assert one("elastron_job_learning_rate") == pytest.approx(0.001)
    assert one("elastron_job_grad_norm") == pytest.approx(1.5)
    assert one("elastron_job_loss_scale") == 1.0
    assert one("elastron_job_tokens_per_second") == 5000
    assert one("elastron_job_last_progress_timestamp_seconds") > 1e9
    assert one("elastron_job_checkpoint_bytes") == 5000
    assert one("elastron_job_step_seconds_count") == 3
    assert one("elastron_job_step_seconds_sum") == pytest.approx(7.4)
    assert one("elastron_job_step_seconds_bucket", le="0.25") == 2
    assert one("elastron_job_step_seconds_bucket", le="+Inf") == 3
    assert one("elastron_job_checkpoint_save_seconds_count") == 1
    assert one("elastron_job_state", state="running") == 1
    assert sum(v for (n, _), v in got.items() if n == "elastron_job_state") == 1
    assert one("elastron_job_state_transitions_total", state="queued") == 1
    assert one("elastron_job_state_transitions_total", state="restarting") == 1
    assert one("elastron_job_restarts_total", cause="worker_died") == 1
    assert one("elastron_job_rerun_events_total", diagnosis="correct_result") == 1
    assert one("elastron_job_recoveries_total", recovered_from="memory") == 1
    assert one("elastron_job_steps_lost_total") == 1
    assert one("elastron_job_recovery_phase_seconds", phase="group_start") == pytest.approx(1.5)
    assert one("elastron_job_checkpoints_total", result="success") == 1
    assert one("elastron_job_checkpoints_total", result="failure") == 0
    assert one("elastron_job_checkpoint_retries_total") == 2  # a save that got over two storage errors
    assert one("elastron_job_phase_seconds", phase="forward", stat="max") == pytest.approx(0.12)
    assert one("elastron_job_phase_seconds", phase="optimizer", stat="min") == pytest.approx(0.01)
    assert 'elastron_jobs{state="running"} 1.0' in text
    assert (
        'elastron_http_requests_total{method="POST",route="/v1/internal/jobs/{job_id}/telemetry",status="200"}'
        in text
    )
    assert "elastron_http_request_duration_seconds_bucket" in text


def test_metrics_names_are_the_documented_ones(env, running):
    """Every elastron_ name on /metrics is in service/METRICS.md, and every documented name is there."""
    job_id, worker = running
    post(
        worker,
        job_id,
        [rec(1, valid_loss=2.0, timers={"forward": [0.1, 0.1]})],
        [
            {"kind": "restart", "cause": "x", "ts": 1.0},
            {
                "kind": "recovered",
                "recovered_from": "replica",
                "steps_lost": 0,
                "phase_seconds": {"agree": 0.1},
                "ts": 1.0,
            },
            {"kind": "diagnosis", "diagnosis": "transient_error", "ts": 1.0},
            {"kind": "checkpoint_saved", "iteration": 1, "seconds": 1.0, "bytes": 1, "uri": "/c", "ts": 1.0},
            {"kind": "replica_lost", "replicas": 1, "stall_s": 0.5, "ts": 1.0},
            {"kind": "replica_rejoined", "replicas": 2, "rejoin_s": 1.5, "ts": 1.0},
        ],
    )
    documented = set(re.findall(r"^\| `(elastron_[a-z_]+)`", METRICS_MD.read_text(), re.M))
    with env.client("admin") as c:
        exposed = {
            f.name
            for f in text_string_to_metric_families(c.get("/metrics").text)
            if f.name.startswith("elastron_")
        }
    # The parser names counters without _total; the document names them with it.
    exposed = {n + "_total" if n + "_total" in documented else n for n in exposed}
    assert exposed == documented


def test_label_values_from_workers_are_escaped(env, running):
    job_id, worker = running
    odd = 'we"ird\\phase\nname'
    post(
        worker,
        job_id,
        [rec(1, timers={odd: [0.1, 0.2]})],
        [{"kind": "restart", "cause": 'a "quoted" cause', "ts": 1.0}],
    )
    with env.client("admin") as c:
        got = samples(c.get("/metrics").text, job_id)  # parses: the text format stays valid
    assert got[("elastron_job_phase_seconds", frozenset({("phase", odd), ("stat", "max")}))] == 0.2
    assert got[("elastron_job_restarts_total", frozenset({("cause", 'a "quoted" cause')}))] == 1


@pytest.mark.parametrize(
    "body, field",
    [
        ({"events": [{"kind": "x", "ts": 1e18}]}, "ts"),  # the fuzzer's find: year out of range
        ({"events": [{"kind": "x", "ts": -1e12}]}, "ts"),
        ({"records": [{"iteration": 1, "ts": 9e15}]}, "ts"),
        ({"events": [{"kind": "checkpoint_saved", "bytes": 2**70}]}, "bytes"),
        ({"events": [{"kind": "checkpoint_saved", "seconds": 1e300}]}, "seconds"),
        ({"records": [{"iteration": 1, "tokens": 2**64}]}, "tokens"),
        ({"records": [{"iteration": 1, "group": 2**40}]}, "group"),
        ({"records": [{"iteration": 1, "anything": 10**30}]}, "anything"),
        ({"records": [{"iteration": 1, "deep": [[[[[[[[1]]]]]]]]}]}, "deep"),
        ({"events": [{"kind": "x", "cause": "c" * 70_000}]}, "cause"),
    ],
)
def test_out_of_bounds_telemetry_is_422_naming_the_field(env, running, body, field):
    job_id, worker = running
    r = worker.post(f"/v1/internal/jobs/{job_id}/telemetry", json=body)
    assert r.status_code == 422, r.text
    assert field in r.text
    with env.client() as c:  # nothing of it was stored, and the job still reads
        assert c.get(f"/v1/jobs/{job_id}/events").status_code == 200
        assert c.get(f"/v1/jobs/{job_id}/metrics").json()["records"] == []


def test_a_stored_row_with_an_impossible_time_does_not_break_reads(env, running):
    """Rows written before the bounds existed: the read paths serve them (time null) instead of 500."""
    job_id, worker = running
    post(worker, job_id, [rec(1)], [{"kind": "checkpoint_saved", "iteration": 1, "uri": "/c", "ts": 5.0}])
    from sqlalchemy import update

    from service.store.db import in_transaction
    from service.store.models import Checkpoint, JobEvent

    def corrupt(session):
        session.execute(update(JobEvent).where(JobEvent.job_id == job_id).values(ts=1e18))
        session.execute(update(Checkpoint).where(Checkpoint.job_id == job_id).values(ts=-1e18))

    in_transaction(env.server.ctx.sessions, corrupt)
    with env.client() as c:
        r = c.get(f"/v1/jobs/{job_id}/events")
        assert r.status_code == 200, r.text
        assert r.json()["events"] and all(e["time"] is None for e in r.json()["events"])
        r = c.get(f"/v1/jobs/{job_id}/checkpoints")
        assert r.status_code == 200 and r.json()["checkpoints"][0]["time"] is None
        assert c.get(f"/v1/jobs/{job_id}").status_code == 200


def test_user_tokens_cannot_post_telemetry(env, running):
    """Telemetry decides a job's state and metrics: only its workers' job token and admins post it."""
    job_id, _ = running
    with env.client("alice") as owner:
        r = owner.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": [rec(1)]})
        assert r.status_code == 403 and "job token" in r.json()["detail"]
    with env.client("bob") as other:  # another tenant does not even learn the job exists
        assert other.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": []}).status_code == 404
    with env.client("admin") as admin:
        r = admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": [rec(1)]})
        assert r.status_code == 200, r.text
    assert env.job(job_id)["iteration"] == 1


def test_a_record_without_a_group_is_dated_by_its_attempt():
    """A replica's records other than the first replica's carry `group: None` (only rank 0 of the
    worker group is told its number): the epoch falls back to the attempt, then to the default,
    never comparing None with a number (the crash a test helper with its own copy of the rule hit)."""
    from engine.jobspec.contract import record_epoch

    assert record_epoch({"iteration": 1, "attempt": 2, "group": 5}, 0) == 5
    assert record_epoch({"iteration": 1, "attempt": 2, "group": None}, 0) == 2
    assert record_epoch({"iteration": 1, "group": True}, 7) == 7  # a bool is not a number here
    assert record_epoch({"iteration": 1}, 7) == 7
