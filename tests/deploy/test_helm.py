"""helm/elastron: linted, rendered and validated offline.

`helm lint --strict` and `helm template` run for the default values and for
helm/examples/gpu-cluster-values.yaml. Every rendered manifest of a built-in kind is validated
against the Kubernetes 1.34 schemas by kubernetes-validate (strict: unknown fields fail). The
custom resources (RayCluster, ServiceMonitor, PodMonitor, PrometheusRule) have no schema there:
they are skipped by kind in that call, their pod templates are validated as core PodTemplates,
and their required fields and cross-references are checked here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_compose import settings_env_names
from tests.deploy.tools import ROOT, run
from tests.tools import missing_tool

try:
    import kubernetes_validate
except ImportError:
    missing_tool("kubernetes-validate", "pip install -e '.[dev]' (pyproject's dev extra)", allow_module_level=True)

CHART = ROOT / "helm" / "elastron"
GPU_VALUES = ROOT / "helm" / "examples" / "gpu-cluster-values.yaml"
KUBERNETES_VERSION = "1.34.0"
# Custom resources: no schema in kubernetes-validate; checked field by field below.
CRD_KINDS = {
    ("ray.io/v1", "RayCluster"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
NAMESPACE = "training"
# Under every value set: the one value without a default, a durable checkpoint location.
DURABLE = ["-f", ROOT / "tests" / "deploy" / "helm-durable-values.yaml"]
VALUE_SETS = {"default": [], "gpu-cluster": ["-f", GPU_VALUES]}


def render(helm: Path, *args: str | Path) -> list[dict[str, Any]]:
    proc = run([helm, "template", "elastron", CHART, "--namespace", NAMESPACE, *DURABLE, *args])
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: Path) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(helm, *VALUE_SETS[request.param])


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = of_kind(docs, kind)
    return doc


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def ray_pod_templates(cluster: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "head", cluster["spec"]["headGroupSpec"]["template"]
    for group in cluster["spec"].get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


# --- helm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_chart_lints_strictly(helm: Path, values: str) -> None:
    proc = run([helm, "lint", "--strict", CHART, *DURABLE, *VALUE_SETS[values]])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_sqlite_store_refuses_a_second_api_replica(helm: Path) -> None:
    proc = run([helm, "template", "elastron", CHART, *DURABLE, "--set", "api.replicas=2"])
    assert proc.returncode != 0
    assert "database.url" in proc.stderr
    render(helm, "--set", "api.replicas=2", "--set", "database.existingSecret=db")


# --- schemas ---------------------------------------------------------------------------------------


def test_manifests_validate_against_kubernetes_schemas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    validated = set()
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        validated.add(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy"} <= validated
    # the GPU example names existing Secrets instead
    assert ("Secret" in validated) == (name == "default")


def test_validation_rejects_a_misspelt_field(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The validation above can fail: strict mode rejects an unknown field."""
    _, docs = rendered
    deployment = one(docs, "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_ray_pod_templates_are_valid_pod_templates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    for group, template in ray_pod_templates(one(docs, "RayCluster")):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": group},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


# --- the RayCluster ---------------------------------------------------------------------------------


def test_raycluster_required_fields(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    cluster = one(docs, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"])
    head = spec["headGroupSpec"]
    assert head["template"]["spec"]["containers"]
    groups = spec["workerGroupSpecs"]
    assert groups and len({g["groupName"] for g in groups}) == len(groups)
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        assert group["template"]["spec"]["containers"], group["groupName"]
    for params in [head.get("rayStartParams", {})] + [g.get("rayStartParams", {}) for g in groups]:
        assert all(isinstance(v, str) for v in params.values()), params  # KubeRay wants strings
    assert len(cluster["metadata"]["name"]) <= 40  # KubeRay derives longer names from it


def test_gpu_workers_give_ray_one_gpu_per_device(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    (gpu,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    (container,) = gpu["template"]["spec"]["containers"]
    resources = container["resources"]
    gpus = int(gpu["rayStartParams"]["num-gpus"])
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == gpus
    assert gpus == (8 if name == "gpu-cluster" else 1)
    assert container["image"].endswith("-gpu")
    tolerations = gpu["template"]["spec"].get("tolerations", [])
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


def test_ray_nodes_share_the_token_and_stop_jobs_with_sigint(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    cluster = one(docs, "RayCluster")
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    token_refs = set()
    for group, template in ray_pod_templates(cluster):
        (container,) = template["spec"]["containers"]
        env = env_of(container)
        assert env["RAY_JOB_STOP_SIGNAL"]["value"] == "SIGINT", group
        assert env["RAY_AUTH_MODE"]["value"] == "token", group
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        token_refs.add((ref["name"], ref["key"]))
        assert env["ELASTRON_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", group
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"]), group
        assert {"name": "metrics", "containerPort": 8080} in container["ports"], group
    api = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    api_ref = env_of(api)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    token_refs.add((api_ref["name"], api_ref["key"]))
    assert len(token_refs) == 1, token_refs
    ((secret_name, key),) = token_refs
    if secret_name in secrets:
        assert key in secrets[secret_name]["data"]
    else:  # the GPU example names an existing Secret
        assert secret_name == yaml.safe_load(GPU_VALUES.read_text())["auth"]["existingSecret"]


# --- the API --------------------------------------------------------------------------------------------


def test_api_runs_the_app_factory_and_reaches_the_ray_head(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    deployment = one(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["uvicorn", "--factory", "service.app:create_app"]
    env = env_of(container)
    cluster = one(docs, "RayCluster")["metadata"]["name"]
    assert env["ELASTRON_RAY_ADDRESS"]["value"] == f"http://{cluster}-head-svc.{NAMESPACE}.svc:8265"
    service = one(docs, "Service")
    assert env["ELASTRON_API_URL"]["value"] == (
        f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
    )
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_api_environment_names_are_control_plane_settings(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    names = {n for n in env_of(container) if n.startswith("ELASTRON_")}
    assert names - settings_env_names() == set()


def test_api_database_url_comes_from_a_secret(helm: Path) -> None:
    docs = render(helm, "--set", "database.url=postgresql+psycopg://u:p@db/elastron")
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    ref = env_of(container)["ELASTRON_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    assert ref["key"] in secrets[ref["name"]]["data"]
    # SQLite (the default) needs no URL
    (default,) = one(render(helm), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "ELASTRON_DATABASE_URL" not in env_of(default)


def test_s3_credentials_come_from_a_secret(helm: Path) -> None:
    docs = render(
        helm,
        "--set", "s3.accessKeyId=AKIAEXAMPLE",
        "--set", "s3.secretAccessKey=secret",
        "--set", "s3.endpointUrl=http://minio.storage:9000",
    )  # fmt: skip
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    containers = [one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]]
    containers += [t["spec"]["containers"][0] for _, t in ray_pod_templates(one(docs, "RayCluster"))]
    for container in containers:
        env = env_of(container)
        assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]]["data"], name


def test_service_selects_the_api_pods(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    service, deployment = one(docs, "Service"), one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port_names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names


def test_gpu_cluster_values_expose_the_api_with_tls(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    ingresses = of_kind(docs, "Ingress")
    if name == "default":
        assert ingresses == []
        return
    (ingress,) = ingresses
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == one(docs, "Service")["metadata"]["name"]
    assert ingress["spec"]["tls"][0]["hosts"] == [ingress["spec"]["rules"][0]["host"]]


# --- monitoring ----------------------------------------------------------------------------------------


def test_service_monitor_scrapes_the_api_and_keeps_job_labels(helm: Path) -> None:
    docs = render(helm, "-f", GPU_VALUES)
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True
    # job="elastron-api", as the alert rules and deploy/prometheus/prometheus.yml expect
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "elastron-api"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # /metrics asks for the scrape token: the monitor sends the one the API reads, from one Secret.
    credentials = endpoint["authorization"]["credentials"]
    (api,) = [
        c for c in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == "api"
    ]
    (token,) = [e for e in api["env"] if e["name"] == "ELASTRON_METRICS_TOKEN"]
    assert endpoint["authorization"]["type"] == "Bearer"
    assert token["valueFrom"]["secretKeyRef"] == {"name": credentials["name"], "key": credentials["key"]}
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    if credentials["name"] in secrets:  # else an existing Secret the values name
        assert credentials["key"] in secrets[credentials["name"]]["data"]
    default = {s["metadata"]["name"]: s for s in of_kind(render(helm), "Secret")}
    assert any("metrics-token" in s["data"] for s in default.values())  # generated when not given


def test_pod_monitor_scrapes_the_ray_pods(helm: Path) -> None:
    docs = render(helm, "-f", GPU_VALUES)
    monitor, cluster = one(docs, "PodMonitor"), one(docs, "RayCluster")
    # KubeRay labels every pod of a cluster with ray.io/cluster: <name>
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    for _, template in ray_pod_templates(cluster):
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def test_prometheus_rule_carries_deploys_rules(helm: Path) -> None:
    rule = one(render(helm, "-f", GPU_VALUES), "PrometheusRule")
    expected = [
        group
        for path in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
        for group in yaml.safe_load(path.read_text())["groups"]
    ]
    assert sorted(rule["spec"]["groups"], key=lambda g: g["name"]) == sorted(
        expected, key=lambda g: g["name"]
    )
    for group in rule["spec"]["groups"]:
        assert group["name"] and all("expr" in r for r in group["rules"])


def test_monitoring_resources_are_off_by_default(helm: Path) -> None:
    kinds = {d["kind"] for d in render(helm)}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def test_dashboards_configmap_holds_deploys_dashboards(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (configmap,) = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboards")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"]["grafana_folder"] == "elastron"
    dashboards = {p.name: p.read_text() for p in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")}
    assert configmap["data"] == dashboards


def test_chart_files_are_copies_of_deploy() -> None:
    pairs = [
        (ROOT / "deploy" / "grafana" / "dashboards", CHART / "files" / "dashboards", "*.json"),
        (ROOT / "deploy" / "prometheus" / "rules", CHART / "files" / "prometheus-rules", "*.yml"),
    ]
    for source, copy, pattern in pairs:
        originals = {p.name: p.read_bytes() for p in source.glob(pattern)}
        copies = {p.name: p.read_bytes() for p in copy.glob(pattern)}
        assert originals and copies == originals, f"{copy} differs: run python deploy/grafana/generate.py"
    assert not any(p.is_symlink() for p in CHART.rglob("*"))


# --- values.yaml is documented ---------------------------------------------------------------------------


def undocumented_values(text: str) -> list[str]:
    """Keys of values.yaml without a comment on the line above. A key whose comment starts with
    "# --" is a documented option; if its value is a block, the block is the option's default and
    its inner keys need no comments of their own."""
    missing: list[str] = []
    value_block_indent: int | None = None  # inside an option's default block
    previous = ""
    for line in text.splitlines():
        stripped = line.strip()
        m = re.match(r"^(\s*)([A-Za-z_][\w./-]*):(.*)$", line)
        if m and not stripped.startswith("#"):
            indent = len(m.group(1))
            if value_block_indent is not None and indent > value_block_indent:
                previous = line
                continue
            value_block_indent = None
            comment = previous.strip()
            if not comment.startswith("#"):
                missing.append(m.group(2))
            elif comment.startswith("# --") and m.group(3).strip() in ("", "|", ">"):
                value_block_indent = indent
        if stripped:
            previous = line
    return missing


def test_values_are_documented() -> None:
    assert undocumented_values((CHART / "values.yaml").read_text()) == []
    assert undocumented_values("a: 1\n# -- b\nb:\n  c: 1\n# section\nd:\n  e: 2\n") == ["a", "e"]
