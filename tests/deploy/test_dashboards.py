"""deploy/grafana: the dashboards and their provisioning.

The dashboards are generated (deploy/grafana/generate.py) and committed; these tests check that
the committed JSON is the generator's output, that it is a well-formed Grafana dashboard, that
every PromQL expression in it parses (promtool, on a rules file built from the expressions), and
that every metric and label it reads is one service/METRICS.md defines, a recording rule of
deploy/prometheus/rules, or NVIDIA DCGM exporter's.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.promql import (
    DCGM_METRICS,
    label_values_query,
    load_metrics_contract,
    recording_rule_labels,
    scan,
    substitute_grafana_variables,
    unknown_names,
)
from tests.deploy.tools import ROOT, run

DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
GENERATOR = ROOT / "deploy" / "grafana" / "generate.py"


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard: panel targets, annotations and the
    selectors of label_values() variables, with dashboard variables substituted."""
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield (
                f"panel {panel['title']!r} {target['refId']}",
                substitute_grafana_variables(target["expr"], variables),
            )
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield (
                f"annotation {annotation['name']!r}",
                substitute_grafana_variables(annotation["expr"], variables),
            )
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector, _ = label_values_query(variable["query"]["query"])
            yield f"variable {variable['name']!r}", substitute_grafana_variables(selector, variables)


def contract_and_rules():
    contract = load_metrics_contract()
    groups = [
        group
        for path in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
        for group in yaml.safe_load(path.read_text())["groups"]
    ]
    return contract, recording_rule_labels(groups, contract)


def by_uid(uid: str) -> dict[str, Any]:
    for path in DASHBOARDS:
        dashboard = load(path)
        if dashboard["uid"] == uid:
            return dashboard
    raise AssertionError(f"no dashboard with uid {uid}")


# --- generated and committed -------------------------------------------------------------------


def test_committed_dashboards_and_chart_copies_are_the_generators_output() -> None:
    proc = run([sys.executable, GENERATOR, "--check"])
    assert proc.returncode == 0, proc.stderr


def test_generator_check_notices_an_edited_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The freshness check above can fail: an edit to a committed file is reported stale."""
    sys.path.insert(0, str(GENERATOR.parent))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(GENERATOR.parent))
    copy = tmp_path / "dashboards"
    copy.mkdir()
    for path in DASHBOARDS:
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / DASHBOARDS[0].name).write_text(DASHBOARDS[0].read_text().replace('"30s"', '"1m"'))
    monkeypatch.setattr(generate, "DASHBOARD_DIR", copy)
    assert generate.stale_files() == [copy / DASHBOARDS[0].name]


# --- well-formed Grafana dashboards --------------------------------------------------------------


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path: Path) -> None:
    dashboard = load(path)
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40
    assert dashboard["title"].startswith("elastron / ")
    assert "elastron" in dashboard["tags"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )

    all_panels = list(panels(dashboard))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    occupied: set[tuple[int, int]] = set()
    for panel in all_panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["description"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"] == panel["datasource"], panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_variable_used_is_defined(path: Path) -> None:
    # substitute_grafana_variables raises on an undefined $name
    assert list(queries(load(path)))


# --- PromQL and the metrics contract --------------------------------------------------------------


def test_every_expression_parses(promtool: Path, tmp_path: Path) -> None:
    """promtool parses each expression as a recording rule; an error names the rule, which names
    the panel."""
    rules, where = [], {}
    for path in DASHBOARDS:
        for i, (place, expr) in enumerate(queries(load(path))):
            name = f"dashboard:{path.stem.replace('-', '_')}:q{i}"
            rules.append({"record": name, "expr": expr})
            where[name] = f"{path.name} {place}"
    rules_file = tmp_path / "dashboard-queries.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = run([promtool, "check", "rules", rules_file])
    output = proc.stdout + proc.stderr
    for name, place in where.items():
        output = output.replace(name, f"{name} ({place})")
    assert proc.returncode == 0, output
    assert f"{len(rules)} rules found" in proc.stdout


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_expressions_read_only_names_from_the_metrics_contract(path: Path) -> None:
    contract, recorded = contract_and_rules()
    problems = [
        f"{place}: {problem}"
        for place, expr in queries(load(path))
        for problem in unknown_names(expr, contract, recorded)
    ]
    assert problems == []


def test_the_name_check_reports_unknown_metrics_labels_and_values() -> None:
    """The check above can fail: misspelt names, labels and label values are reported."""
    contract, recorded = contract_and_rules()
    expr = (
        'sum by (phases) (elastron_job_phase_seconds{phase="fwd", stat="max", rank="0"})'
        " + elastron_job_losss + DCGM_FI_DEV_POWER_USAGE{Hostname=~'.*'}"
        ' + elastron_job:tokens_per_second:rate2m{state="running"}'
    )
    problems = unknown_names(expr, contract, recorded)
    assert any("'phases'" in p for p in problems)
    assert any("fwd" in p for p in problems)
    assert any("'rank'" in p for p in problems)
    assert any("elastron_job_losss" in p for p in problems)
    assert any("elastron_job:tokens_per_second:rate2m has no label 'state'" in p for p in problems)
    assert len(problems) == 5, problems


def test_metrics_contract_is_read_from_metrics_md() -> None:
    contract = load_metrics_contract()
    assert len(contract.metrics) >= 20
    assert contract.metrics["elastron_job_step_seconds"].series == {
        "elastron_job_step_seconds_bucket",
        "elastron_job_step_seconds_sum",
        "elastron_job_step_seconds_count",
    }
    assert {"phase", "stat", "job", "tenant"} <= contract.metrics["elastron_job_phase_seconds"].labels
    assert {"forward", "backward", "optimizer", "data"} <= contract.label_values["phase"]
    assert "failed" in contract.label_values["state"]


# --- what the issue asks the dashboards to show ---------------------------------------------------


def titles(dashboard: dict[str, Any]) -> set[str]:
    return {p["title"] for p in panels(dashboard)}


def metric_names(dashboard: dict[str, Any]) -> set[str]:
    return {sel.metric for _, expr in queries(dashboard) for sel in scan(expr).selectors if sel.metric}


def test_jobs_dashboard_shows_the_fleet() -> None:
    dashboard = by_uid("elastron-jobs")
    assert dashboard["title"] == "elastron / Jobs"
    assert {
        "Jobs by state",
        "Submissions and outcomes",
        "Restarts by cause",
        "Rerun diagnoses",
        "Checkpoint saves",
        "Checkpoint success ratio",
        "Checkpoint save duration",
        "API latency (p95) by route",
    } <= titles(dashboard)
    assert {
        "elastron_jobs",
        "elastron_job_state_transitions_total",
        "elastron_job_restarts_total",
        "elastron_job_rerun_events_total",
        "elastron_job_checkpoints_total",
        "elastron_job_checkpoint_save_seconds_bucket",
        "elastron_http_request_duration_seconds_bucket",
    } <= metric_names(dashboard)


def test_training_dashboard_shows_one_job() -> None:
    dashboard = by_uid("elastron-training")
    assert dashboard["title"] == "elastron / Training"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert label_values_query(variables["job"]["query"]["query"])[1] == "job"
    assert {
        "Loss",
        "Learning rate",
        "Gradient norm",
        "Tokens per second",
        "MFU",
        "Step time",
        "Step time breakdown",
        "Energy per step",
        "Energy per token",
        "Power",
        "Cumulative energy",
        "Loss scale",
        "Skipped iterations",
        "Restarts by cause",
    } <= titles(dashboard)
    # Every per-job query is for the chosen job.
    for place, expr in queries(dashboard):
        for sel in scan(expr).selectors:
            if sel.metric and sel.metric.startswith("elastron_job") and not place.startswith("variable"):
                assert ("job", "=", "value") in sel.matchers, f"{place}: {expr}"


def test_step_time_breakdown_covers_every_timer_phase() -> None:
    dashboard = by_uid("elastron-training")
    (panel,) = [p for p in panels(dashboard) if p["title"] == "Step time breakdown"]
    phases = set()
    for target in panel["targets"]:
        phases |= set(re.findall(r'phase="([^"]+)"', target["expr"]))
    assert phases == load_metrics_contract().label_values["phase"]
    legends = {t["legendFormat"] for t in panel["targets"]}
    assert {"pipeline p2p + bubbles", "DP gradient reduction", "checkpoint save"} <= legends


def test_restarts_and_their_causes_are_annotations() -> None:
    dashboard = by_uid("elastron-training")
    annotations = {a["name"]: a for a in dashboard["annotations"]["list"] if "expr" in a}
    assert "elastron_job_restarts_total" in annotations["Restarts"]["expr"]
    assert "{{cause}}" in annotations["Restarts"]["textFormat"]
    assert "{{diagnosis}}" in annotations["Rerun diagnoses"]["textFormat"]


def test_gpu_row_sets_dcgm_beside_the_jobs_figures() -> None:
    dashboard = by_uid("elastron-training")
    (row,) = [p for p in dashboard["panels"] if p["type"] == "row" and "DCGM" in p["title"]]
    row_metrics = {
        sel.metric
        for panel in row["panels"]
        for target in panel["targets"]
        for sel in scan(substitute_grafana_variables(target["expr"], {"job", "gpu_node", "tenant"})).selectors
    }
    assert DCGM_METRICS <= row_metrics
    assert {
        "elastron_job_power_watts",
        "elastron_job_energy_joules_total",
        "elastron_job_mfu_ratio",
    } <= row_metrics


# --- provisioning -----------------------------------------------------------------------------------


def test_provisioning_points_grafana_at_prometheus_and_the_dashboards() -> None:
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    (prometheus,) = [d for d in datasources if d["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "elastron.yml").read_text())["providers"]
    (provider,) = providers
    assert provider["type"] == "file"
    # The compose file mounts deploy/grafana/dashboards at this path (tests/deploy/test_compose.py).
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/elastron"


def _generator():
    sys.path.insert(0, str(GENERATOR.parent))
    try:
        import generate  # deploy/grafana/generate.py: standard library only
    finally:
        sys.path.pop(0)
    return generate


def test_sums_over_store_series_take_the_max_across_api_replicas_first() -> None:
    """Every API replica exports the same per-job series (issue 61): a dashboard that sums them
    as scraped shows each job once per replica (two replicas: 20 tokens/s for 10)."""
    once = _generator().counted_once
    assert once("sum(rate(elastron_job_tokens_total{job=\"a\"}[5m]))") == (
        'sum(max without (instance, pod) (rate(elastron_job_tokens_total{job="a"}[5m])))'
    )
    assert once("histogram_quantile(0.5, sum by (le) (rate(elastron_job_step_seconds_bucket[1m])))") == (
        "histogram_quantile(0.5, sum by (le) (max without (instance, pod) "
        "(rate(elastron_job_step_seconds_bucket[1m]))))"
    )
    # Each replica's own series add up; recording-rule outputs are already counted once.
    for own in ("sum by (status) (rate(elastron_http_requests_total[1m]))", "sum(elastron_job:tokens_per_second:rate2m)"):
        assert once(own) == own
    assert once(once("sum(elastron_jobs)")) == "sum(max without (instance, pod) (elastron_jobs))"
    store = re.compile(r"\belastron_jobs\b|\belastron_job_")
    summed = re.compile(r"\bsum(?:\s+by\s*\([^()]*\))?\s*\(")
    checked = 0
    for path in DASHBOARDS:
        for where, expr in queries(load(path)):
            for m in summed.finditer(expr):
                inner = _balanced(expr[m.end() :])
                if store.search(inner):
                    checked += 1
                    assert inner.startswith("max without (instance, pod)"), f"{path.name} {where}: {expr}"
    assert checked >= 20  # the fleet's and one job's counters, rates and histograms


def _balanced(text: str) -> str:
    """The text up to the parenthesis that closes an already-open one."""
    depth = 1
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[:i]
    return text
