"""A /metrics scrape reads the store with a fixed number of queries, whatever the number of jobs
(the collector never queries per job), and shows every non-final job plus recently finished ones."""

from __future__ import annotations

from sqlalchemy import event, update

from service.store.db import in_transaction
from service.store.models import Job
from tests.service.test_api_jobs import TINY


def test_scrape_queries_do_not_grow_with_jobs(start_env):
    env = start_env(reconcile=False, submit_burst=1000, metrics_token="scrape-token")
    engine = env.server.ctx.engine
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))

    def scrape() -> tuple[str, int]:
        statements.clear()
        with env.client(token="scrape-token") as c:  # Prometheus' token: no store lookup
            text = c.get("/metrics").text
        return text, len(statements)

    with env.client() as c:
        ids = [c.post("/v1/jobs", json={**TINY, "name": f"m{i}"}).json()["id"] for i in range(100)]
    record = {"iteration": 1, "loss": 2.0, "tokens": 10, "step_time_s": 0.1}
    with env.client("admin") as admin:  # telemetry takes a job token or an admin token
        for job_id in ids[:50]:
            admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": [record]})
    text, queries = scrape()
    assert queries == 5  # the jobs shown, counts per state, the scheduler's row, sweeps and trials, evaluations
    assert all(f'elastron_job_iteration{{job="{i}",tenant="alice"}} 1.0' in text for i in ids[:50])
    assert all(f'elastron_job_state{{job="{i}",tenant="alice",state="queued"}} 1.0' in text for i in ids[50:])
    assert 'elastron_jobs{state="queued"} 50.0' in text and 'elastron_jobs{state="running"} 50.0' in text

    # Finished long ago: counted in elastron_jobs, no longer a per-job series.
    in_transaction(
        env.server.ctx.sessions,
        lambda s: s.execute(
            update(Job).where(Job.id.in_(ids[:10])).values(state="succeeded", finished_at=1.0)
        ),
    )
    text, queries = scrape()
    assert queries == 5  # the jobs shown, counts per state, the scheduler's row, sweeps and trials, evaluations
    assert not any(f'job="{i}"' in text for i in ids[:10]) and f'job="{ids[10]}"' in text
    assert 'elastron_jobs{state="succeeded"} 10.0' in text
