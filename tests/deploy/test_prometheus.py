"""deploy/prometheus: the scrape configuration, recording rules and alerts.

promtool checks the configuration and the rule files and runs the rules' unit tests
(deploy/prometheus/tests); the rest checks what promtool cannot: that every alert is tested both
firing and quiet, that the rules read only names service/METRICS.md defines, and that the API's
scrape keeps the per-job `job` label.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy.promql import load_metrics_contract, recording_rule_labels, unknown_names
from tests.deploy.tools import ROOT, run

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))


def rule_groups() -> list[dict]:
    return [group for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]]


def alerts() -> list[dict]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def test_config_and_the_rule_files_it_loads_are_valid(promtool: Path, tmp_path: Path) -> None:
    # The API's scrape token file exists in the container only (a compose secret): check a copy
    # of the config that names a local one, beside the same rule files.
    token = tmp_path / "metrics_token"
    token.write_text("token")
    copy = tmp_path / "prometheus.yml"
    copy.write_text(CONFIG.read_text().replace("/run/secrets/metrics_token", str(token)))
    (tmp_path / "rules").symlink_to(CONFIG.parent / "rules")
    proc = run([promtool, "check", "config", copy])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # check config also checks every rule file the config loads: make sure it loads them all.
    for path in RULE_FILES:
        assert f"rules/{path.name}" in proc.stdout, (
            f"prometheus.yml does not load {path.name}:\n{proc.stdout}"
        )


def test_rule_files_are_valid(promtool: Path) -> None:
    assert RULE_FILES
    proc = run([promtool, "check", "rules", *RULE_FILES])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rule_unit_tests_pass(promtool: Path) -> None:
    assert RULE_TESTS
    proc = run([promtool, "test", "rules", *RULE_TESTS])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        suite = yaml.safe_load(path.read_text())
        assert {Path(f).name for f in suite["rule_files"]} == {p.name for p in RULE_FILES}, path
        for case in suite["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"


def test_the_issue_asks_for_these_alerts() -> None:
    names = {rule["alert"] for rule in alerts()}
    assert {
        "ElastronJobFailed",
        "ElastronJobStalled",
        "ElastronJobRestartingOften",
        "ElastronJobLowMFU",
        "ElastronRerunPersistentError",
    } <= names


def test_alerts_carry_severity_summary_and_description() -> None:
    for rule in alerts():
        assert rule.get("labels", {}).get("severity") in {"info", "warning", "critical"}, rule["alert"]
        assert rule.get("annotations", {}).get("summary"), rule["alert"]
        assert rule.get("annotations", {}).get("description"), rule["alert"]


def test_recording_rules_give_per_job_tokens_per_second_and_mfu() -> None:
    contract = load_metrics_contract()
    recorded = recording_rule_labels(rule_groups(), contract)
    assert recorded["elastron_job:tokens_per_second:rate2m"] == {"job", "tenant"}
    assert recorded["elastron_job:mfu_ratio:avg10m"] == {"job", "tenant"}


@pytest.mark.parametrize(
    "rule", [r for g in rule_groups() for r in g["rules"]], ids=lambda r: r.get("alert") or r.get("record")
)
def test_rules_read_only_names_from_the_metrics_contract(rule: dict) -> None:
    contract = load_metrics_contract()
    assert unknown_names(rule["expr"], contract, recording_rule_labels(rule_groups(), contract)) == []


def test_api_scrape_keeps_the_per_job_job_label() -> None:
    """Per-job series carry job=<elastron job id>. Without honor_labels Prometheus would rename
    it to exported_job and set job to the scrape job's name, and every per-job dashboard panel
    and alert would group all jobs into one."""
    config = yaml.safe_load(CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    api = jobs["elastron-api"]
    assert api.get("honor_labels") is True
    assert api.get("metrics_path", "/metrics") == "/metrics"
    # The ApiDown alert selects the API by this scrape job name.
    assert any('up{job="elastron-api"}' in rule["expr"] for rule in alerts())
    assert "ray" in jobs, "Ray's metrics endpoint is not scraped"
