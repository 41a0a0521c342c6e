"""helm/elastron refuses unsafe settings (issue 61): a durable checkpoint location is required
(the chart fails to render when jobs would checkpoint to the pods' throwaway filesystem), the
values are checked against values.schema.json, the API has a PodDisruptionBudget, NetworkPolicies
admit only what each pod needs, and the API and the Ray pods run as separate ServiceAccounts
that mount no Kubernetes token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_helm import (
    CHART,
    DURABLE,
    GPU_VALUES,
    NAMESPACE,
    env_of,
    of_kind,
    one,
    ray_pod_templates,
    render,
)
from tests.deploy.tools import run


def template(helm: Path, *args: str | Path):
    return run([helm, "template", "elastron", CHART, "--namespace", NAMESPACE, *args])


# --- a durable checkpoint location --------------------------------------------------------------


@pytest.mark.parametrize(
    "values, says",
    [
        ([], "api.checkpointDir is empty: jobs would checkpoint to the pods' throwaway filesystem"),
        (["--set", "api.checkpointDir=/var/lib/elastron/checkpoints"], "is a path in the pods' throwaway filesystem"),
        (["--set", "api.checkpointDir=/elsewhere/ckpt", "--set", "checkpointVolume.existingClaim=shared"],
         "is not under checkpointVolume.mountPath"),
    ],
    ids=["unset", "pod-local-path", "outside-the-volume"],
)
def test_no_durable_checkpoint_location_refuses_to_render(helm: Path, values: list[str], says: str) -> None:
    proc = template(helm, *values)
    assert proc.returncode != 0, "rendered without a durable checkpoint location"
    assert says in proc.stderr, proc.stderr
    assert "s3://BUCKET/PREFIX" in proc.stderr and "checkpointVolume.existingClaim" in proc.stderr  # the fix
    # (`helm lint` only logs a template's `fail`, at INFO: rendering is what install and upgrade do)


def test_s3_checkpoints_reach_the_api(helm: Path) -> None:
    docs = render(helm, "--set", "api.checkpointDir=s3://bucket/elastron")
    api = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(api)["ELASTRON_CHECKPOINT_DIR"]["value"] == "s3://bucket/elastron"


def test_a_shared_volume_is_mounted_on_the_api_and_every_ray_pod(helm: Path) -> None:
    docs = render(
        helm,
        "--set", "api.checkpointDir=/mnt/checkpoints/jobs",
        "--set", "checkpointVolume.existingClaim=shared-ckpt",
        "--set", "ray.cpuWorkers.enabled=true",
    )
    deployment = one(docs, "Deployment")["spec"]["template"]
    pods = [("api", deployment), *ray_pod_templates(one(docs, "RayCluster"))]
    assert [name for name, _ in pods] == ["api", "head", "gpu", "cpu"]
    for name, pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "shared-ckpt"}, name
        (container,) = pod["spec"]["containers"]
        assert {"name": "checkpoints", "mountPath": "/mnt/checkpoints"} in container["volumeMounts"], name
    api = deployment["spec"]["containers"][0]
    assert env_of(api)["ELASTRON_CHECKPOINT_DIR"]["value"] == "/mnt/checkpoints/jobs"


def test_values_yaml_says_what_an_empty_checkpoint_dir_does() -> None:
    text = (CHART / "values.yaml").read_text()
    assert "do not checkpoint" not in text
    assert "refuses to render without a durable location" in text


# --- values schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, says",
    [
        ("api.replicas=two", "/api/replicas"),
        ("api.replicas=0", "/api/replicas"),
        ("api.replicaz=2", "replicaz"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("api.service.port=70000", "/api/service/port"),
        ("api.checkpointDir=gs://bucket/x", "/api/checkpointDir"),
        ("api.checkpointDir=s3://", "/api/checkpointDir"),  # no bucket
        ("api.checkpointDir=relative/path", "/api/checkpointDir"),
    ],
)
def test_the_schema_rejects_a_bad_value(helm: Path, setting: str, says: str) -> None:
    proc = template(helm, *DURABLE, "--set", setting)
    assert proc.returncode != 0, f"{setting} rendered"
    assert "schema" in proc.stderr and says in proc.stderr, proc.stderr


def test_the_schema_accepts_the_shipped_values(helm: Path) -> None:
    for values in ([], ["-f", GPU_VALUES]):
        assert template(helm, *DURABLE, *values).returncode == 0


# --- PodDisruptionBudget ------------------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_the_api_has_a_pod_disruption_budget(helm: Path) -> None:
    docs = render(helm, "--set", "api.replicas=3", "--set", "database.existingSecret=db")
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    api_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert _selects(pdb["spec"]["selector"], api_labels)
    assert not of_kind(render(helm, "--set", "api.podDisruptionBudget.enabled=false"), "PodDisruptionBudget")


# --- NetworkPolicy ------------------------------------------------------------------------------------


def _policies(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], str, dict[str, str]]:
    cluster = one(docs, "RayCluster")["metadata"]["name"]
    api_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    policies = of_kind(docs, "NetworkPolicy")
    (api,) = [p for p in policies if _selects(p["spec"]["podSelector"], api_labels)]
    (ray,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": cluster}]
    return api, ray, cluster, api_labels


def test_network_policies_admit_only_what_each_pod_needs(helm: Path) -> None:
    docs = render(helm)
    api, ray, cluster, api_labels = _policies(docs)
    ray_peer = {"podSelector": {"matchLabels": {"ray.io/cluster": cluster}}}
    for policy in (api, ray):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    # The API: its port, from anyone by default (users, the Ingress controller, Prometheus).
    (rule,) = api["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}] and "from" not in rule
    # Ray: every port from the API and the cluster's own pods; the metrics port from Prometheus.
    everything, metrics = ray["spec"]["ingress"]
    assert "ports" not in everything
    (api_peer, own) = everything["from"]
    assert _selects(api_peer["podSelector"], api_labels) and own == ray_peer
    assert metrics["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_restricting_the_api_keeps_the_ranks_telemetry(helm: Path) -> None:
    docs = render(helm, "--set-json", 'networkPolicy.apiFrom=[{"namespaceSelector":{"matchLabels":{"team":"ml"}}}]')
    api, _, cluster, _ = _policies(docs)
    (rule,) = api["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
        {"podSelector": {"matchLabels": {"ray.io/cluster": cluster}}},
    ]
    assert not of_kind(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy")


# --- ServiceAccounts ------------------------------------------------------------------------------------


def test_the_api_and_the_ray_pods_have_separate_service_accounts(helm: Path) -> None:
    docs = render(helm, "-f", GPU_VALUES, "--set", "ray.cpuWorkers.enabled=true")
    accounts = {a["metadata"]["name"]: a for a in of_kind(docs, "ServiceAccount")}
    api_account = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    ray_accounts = {t["spec"]["serviceAccountName"] for _, t in ray_pod_templates(one(docs, "RayCluster"))}
    assert len(ray_accounts) == 1 and api_account not in ray_accounts
    (ray_account,) = ray_accounts
    assert set(accounts) == {api_account, ray_account}
    for account in accounts.values():
        assert account["automountServiceAccountToken"] is False
    role = "eks.amazonaws.com/role-arn"
    assert accounts[api_account]["metadata"]["annotations"][role].endswith("/elastron-api")
    assert accounts[ray_account]["metadata"]["annotations"][role].endswith("/elastron-checkpoints")
