"""The dashboards, recording rules and alerts against the real API, scraped by a real Prometheus.

The control plane (`service.app.create_app`, with the service tests' fake Ray launcher reporting
one 8-CPU node, so the scheduler runs) runs on a loopback port; four jobs go through it: one
trains and reports telemetry in two batches (every field of the engine's metrics record,
checkpoints, a restart and its recovery, two rerun diagnoses, an evaluation of a checkpoint), one succeeds, one fails, one is
cancelled; then an urgent job preempts a low-priority one (the scheduler's series). Prometheus scrapes /metrics every second with the API scrape settings of
deploy/prometheus/prometheus.yml and evaluates deploy/prometheus/rules. Then:

- the names on /metrics are exactly service/METRICS.md's, with its labels, and pass
  `promtool check metrics`;
- per-job series keep their `job` label (honor_labels), nothing is renamed to exported_job;
- every query of both dashboards runs, and returns data unless it reads DCGM's GPU metrics;
- the recording rules give the training job's tokens/s, MFU, step time, energy per token and
  restarts, and the failed-job and persistent-error alerts fire.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.promql import DCGM_METRICS, label_values_query, load_metrics_contract
from tests.deploy.tools import ROOT, run

pytest.importorskip("service.app", reason="service/app.py (the API with create_app) does not exist yet")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine.launcher import free_port
from service.app import create_app  # noqa: E402
from service.launcher import LaunchStatus  # noqa: E402
from service.scheduling.model import Node  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store.db import make_engine, make_sessionmaker  # noqa: E402
from service.store.migrate import upgrade  # noqa: E402
from service.store.tokens import create_token  # noqa: E402
from tests.service.launchers import FakeLauncher  # noqa: E402
from tests.waiting import wait_for

DEPLOY = ROOT / "deploy"
METRICS_TOKEN = "scrape-token-for-the-test"  # what deploy's Prometheus reads from its secret file
SCRAPE_AUTH = {"Authorization": f"Bearer {METRICS_TOKEN}"}
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
JOB_SPEC = yaml.safe_load((ROOT / "examples" / "llama_tiny_tp2.yaml").read_text())
TIMERS = ["data", "forward", "backward", "forward-backward", "grads-finalize", "optimizer", "checkpoint-save"]


def record(iteration: int) -> dict[str, Any]:
    """An engine metrics record (README, "Running your own job") with every field set."""
    return {
        "iteration": iteration,
        "loss": 4.0 - 0.1 * iteration,
        "lr": 3e-3,
        "grad_norm": 1.2,
        "tokens": 2048,
        "step_time_s": 0.4,
        "tokens_per_s": 5120.0,
        "global_batch_size": 16,
        "consumed_samples": 16 * iteration,
        "loss_scale": 65536.0,
        "skipped": iteration == 3,
        "model_flops": 2.1e10,
        "mfu": 0.31,
        "energy_j": 120.0,
        "power_w": 300.0,
        "energy_cumulative_j": 120.0 * iteration,
        "valid_loss": 3.9 if iteration % 5 == 0 else None,
        "valid_ppl": None,
        "timers": {name: [0.01 * (i + 1), 0.012 * (i + 1)] for i, name in enumerate(TIMERS)},
        "timers_per_rank": {"forward-backward": [0.04, 0.048]},
    }


class Api:
    """The API served by uvicorn in a thread, over a fresh SQLite store."""

    def __init__(self, home: Path) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = Settings(
            home=home,
            api_url=self.url,
            reconcile_interval_s=0.1,
            checkpoint_dir=str(home / "ck"),
            metrics_token=METRICS_TOKEN,
        )
        engine = make_engine(self.settings.resolved_database_url)
        upgrade(engine)
        self.admin_token = create_token(make_sessionmaker(engine), "ops", admin=True)[1]
        engine.dispose()
        self.launcher = FakeLauncher()
        app = create_app(self.settings, launcher=self.launcher)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), what="the API to start")
        assert self.server.started, "the API did not start"
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_token}"})

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(30)

    def submit(self, name: str, **sections: Any) -> str:
        r = self.client.post("/v1/jobs", json={**JOB_SPEC, "name": name, **sections})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.client.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_state(self, job_id: str, state: str) -> dict[str, Any]:
        return wait_for(
            lambda: (j := self.job(job_id))["state"] == state and j, what=f"{job_id} to be {state}"
        )

    def telemetry(self, job_id: str, records: list[dict], events: list[dict]) -> None:
        token = self.launcher.env_of(job_id)["ELASTRON_API_TOKEN"]
        r = httpx.post(
            f"{self.url}/v1/internal/jobs/{job_id}/telemetry",
            json={"records": records, "events": events},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200, r.text


class Prometheus:
    """A Prometheus server on loopback with deploy/'s API scrape job and rules, scraping every second."""

    def __init__(self, binary: Path, api_port: int, workdir: Path) -> None:
        deploy_config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        (api_job,) = [j for j in deploy_config["scrape_configs"] if j["job_name"] == "elastron-api"]
        # deploy's scrape job as is, but for the target and where the scrape token's file is
        (workdir / "metrics_token").write_text(METRICS_TOKEN)
        authorization = {**api_job["authorization"], "credentials_file": str(workdir / "metrics_token")}
        api_job = {
            **api_job,
            "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}],
            "authorization": authorization,
        }
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))],
            "scrape_configs": [api_job],
        }
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self.ready, what="Prometheus to be ready")

    def ready(self) -> bool:
        assert self.process.poll() is None, f"Prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as err:
            raise AssertionError(f"query failed: {expr}\n{err.read().decode()}") from err
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prometheus_bin: Path) -> Iterator[dict[str, Any]]:
    """The API with four jobs (trained / succeeded / failed / cancelled) and Prometheus scraping it."""
    workdir = tmp_path_factory.mktemp("scrape")
    api = Api(workdir / "home")
    api.launcher.nodes = [Node("node-1", cpus=8, gpus=0)]  # 4 jobs x 2 ranks fill it
    prometheus = None
    try:
        trained, succeeded = api.submit("trained"), api.submit("succeeded")
        failed, cancelled = api.submit("failed"), api.submit("cancelled")
        for job_id in (trained, succeeded, failed, cancelled):
            api.wait_state(job_id, "starting")
        api.launcher.set_status(api.job(trained)["submission_id"], LaunchStatus.RUNNING)
        api.telemetry(
            trained,
            [record(i) for i in range(1, 6)],
            [
                {
                    "kind": "checkpoint_saved",
                    "iteration": 5,
                    "seconds": 2.5,
                    "bytes": 123456,
                    "uri": "s3://b/ck/5",
                },
                {"kind": "diagnosis", "iteration": 4, "diagnosis": "transient_error", "rank": 0},
            ],
        )
        api.wait_state(trained, "running")
        prometheus = Prometheus(prometheus_bin, api.port, workdir)
        wait_for(lambda: prometheus.query('up{job="elastron-api"} == 1'), what="a scrape of the API")
        # A second batch after Prometheus has seen the first, so counters rise between scrapes.
        time.sleep(2)
        api.telemetry(
            trained,
            [record(i) for i in range(6, 11)],
            [
                {"kind": "restart", "cause": "node_lost", "iteration": 7},
                {
                    "kind": "recovered",
                    "recovered_from": "replica",
                    "steps_lost": 1,
                    "iteration": 7,
                    "phase_seconds": {"group_start": 4.2, "restore": 0.02},
                },
                {"kind": "diagnosis", "iteration": 8, "diagnosis": "persistent_error", "rank": 1},
                # replace_replica: the survivors stepped without a replica, then it rejoined
                {"kind": "replica_lost", "iteration": 8, "replicas": 1, "stall_s": 0.6},
                {"kind": "replica_rejoined", "iteration": 9, "replicas": 2, "rejoin_s": 1.4},
                {
                    "kind": "checkpoint_saved",
                    "iteration": 10,
                    "seconds": 3.0,
                    "bytes": 123999,
                    "uri": "s3://b/ck/10",
                },
            ],
        )
        # An evaluation of the trained job's checkpoint (its scores' series): the fake launcher
        # ends it with the line `elastron eval --print-json` ends its log with.
        r = api.client.post(f"/v1/jobs/{trained}/checkpoints/10/evals", json={"tasks": ["elastron_mc"]})
        assert r.status_code == 202, r.text
        sid = r.json()["submission_id"]
        wait_for(lambda: sid in api.launcher.submissions, what="the evaluation's submission")
        api.launcher.logs_of[sid] = 'eval-result {"results": {"elastron_mc": {"acc,none": 0.5}}}'
        api.launcher.set_status(sid, LaunchStatus.SUCCEEDED)
        wait_for(
            lambda: api.client.get(f"/v1/jobs/{trained}/evals").json()["evals"][0]["status"] == "succeeded",
            what="the evaluation to succeed",
        )
        api.launcher.set_status(api.job(succeeded)["submission_id"], LaunchStatus.SUCCEEDED)
        api.wait_state(succeeded, "succeeded")
        api.launcher.set_status(api.job(failed)["submission_id"], LaunchStatus.FAILED, "exit code 1")
        api.wait_state(failed, "failed")
        assert api.client.post(f"/v1/jobs/{cancelled}/cancel").status_code in (200, 202)
        api.wait_state(cancelled, "cancelled")
        # 6 CPUs free: an elastic job takes 4, a low-priority job 2; an urgent one needing 4
        # shrinks the elastic one to 2 and preempts the low one.
        flex = api.submit("flex", resources={"ranks": 4, "min_ranks": 2}, checkpoint={"interval": 5})
        api.wait_state(flex, "starting")
        low = api.submit("low", resources={"ranks": 2}, checkpoint={"interval": 5})
        api.wait_state(low, "starting")
        urgent = api.submit("urgent", resources={"ranks": 4}, scheduling={"priority": 10})
        for job_id, kind in ((low, "preempting"), (flex, "resizing")):
            wait_for(
                lambda j=job_id, k=kind: any(e["kind"] == k for e in api.client.get(f"/v1/jobs/{j}/events").json()["events"]),
                what=kind,
            )
        assert api.job(urgent)["state"] == "queued"
        # Wait until Prometheus has the second batch and has evaluated the rules on it.
        wait_for(
            lambda: prometheus.query(f'elastron_job:restarts:increase1h{{job="{trained}"}} > 0'),
            what="the rules to see the restart",
        )
        time.sleep(2)
        yield {
            "api": api,
            "prometheus": prometheus,
            "jobs": {"trained": trained, "succeeded": succeeded, "failed": failed, "cancelled": cancelled},
        }
    finally:
        if prometheus is not None:
            prometheus.stop()
        api.stop()


# --- /metrics against METRICS.md ------------------------------------------------------------------


def test_exported_names_and_labels_are_exactly_metrics_md(stack: dict[str, Any]) -> None:
    contract = load_metrics_contract()
    exposition = httpx.get(f"{stack['api'].url}/metrics", headers=SCRAPE_AUTH).text
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        if not family.name.startswith("elastron_"):
            continue
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    # counters: METRICS.md names them with _total; histograms: _bucket/_sum/_count
    series = contract.series_names()
    assert set(exported) - set(series) == set(), "exported but not in METRICS.md"
    names_seen = {series[name].name for name in exported}
    assert set(contract.metrics) - names_seen == set(), "in METRICS.md but not exported"
    for name, labels in exported.items():
        allowed = series[name].labels | {"le"}
        assert labels <= allowed, f"{name}: labels {sorted(labels - allowed)} are not in METRICS.md"


def test_exposition_passes_promtool_lint(stack: dict[str, Any], promtool: Path) -> None:
    exposition = httpx.get(f"{stack['api'].url}/metrics", headers=SCRAPE_AUTH).text
    proc = run([promtool, "check", "metrics"], input=exposition)
    # promtool exits 1 on lint findings too; only report the ones about elastron's own names.
    findings = [line for line in (proc.stdout + proc.stderr).splitlines() if "elastron_" in line]
    assert findings == [], "\n".join(findings)


# --- in Prometheus ------------------------------------------------------------------------------------


def test_per_job_series_keep_their_job_label(stack: dict[str, Any]) -> None:
    prometheus, jobs = stack["prometheus"], stack["jobs"]
    loss = prometheus.query("elastron_job_loss")
    assert {s["metric"]["job"] for s in loss} == {jobs["trained"]}
    assert prometheus.query('{exported_job!=""}') == []
    # series without a job label of their own get the scrape job's
    assert {s["metric"]["job"] for s in prometheus.query("elastron_jobs")} == {"elastron-api"}


def fill(expr: str, values: dict[str, str]) -> str:
    for name, duration in {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}.items():
        expr = expr.replace(name, duration)
    return re.sub(r"\$\{?(\w+)(?::\w+)?\}?", lambda m: values[m.group(1)], expr)


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for target in p.get("targets", []):
                yield f"{dashboard['title']} / {p['title']} {target['refId']}", target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"{dashboard['title']} / annotation {annotation['name']}", annotation["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield (
                f"{dashboard['title']} / variable {variable['name']}",
                label_values_query(variable["query"]["query"])[0],
            )


def test_every_dashboard_query_returns_data(stack: dict[str, Any]) -> None:
    prometheus = stack["prometheus"]
    values = {"job": stack["jobs"]["trained"], "tenant": ".*", "gpu_node": ".*", "datasource": "prometheus"}
    empty = []
    for path in DASHBOARDS:
        for place, expr in dashboard_queries(json.loads(path.read_text())):
            result = prometheus.query(fill(expr, values))
            if not result and not any(name in expr for name in DCGM_METRICS):
                empty.append(f"{place}: {expr}")
    assert empty == [], "queries without data:\n" + "\n".join(empty)


def test_recording_rules_give_the_jobs_figures(stack: dict[str, Any]) -> None:
    prometheus, trained = stack["prometheus"], stack["jobs"]["trained"]

    def value(expr: str) -> float:
        (sample,) = prometheus.query(expr)
        return float(sample["value"][1])

    assert value(f'elastron_job:tokens_per_second:rate2m{{job="{trained}"}}') > 0
    assert value(f'elastron_job:mfu_ratio:avg10m{{job="{trained}"}}') == pytest.approx(0.31)
    assert value(f'elastron_job:step_seconds:mean2m{{job="{trained}"}}') == pytest.approx(0.4)
    assert value(f'elastron_job:energy_joules_per_token:rate2m{{job="{trained}"}}') == pytest.approx(
        120 / 2048
    )
    assert value(f'elastron_job:restarts:increase1h{{job="{trained}"}}') == pytest.approx(1)


def test_alerts_fire_for_the_failed_job_and_the_persistent_error(stack: dict[str, Any]) -> None:
    prometheus, jobs = stack["prometheus"], stack["jobs"]

    def firing(alert: str) -> set[str]:
        return {
            s["metric"]["job"]
            for s in prometheus.query(f'ALERTS{{alertname="{alert}", alertstate="firing"}}')
        }

    wait_for(lambda: firing("ElastronJobFailed") == {jobs["failed"]}, what="ElastronJobFailed")
    wait_for(
        lambda: firing("ElastronRerunPersistentError") == {jobs["trained"]},
        what="ElastronRerunPersistentError",
    )
    assert firing("ElastronApiDown") == set()
    assert firing("ElastronJobStalled") == set()
