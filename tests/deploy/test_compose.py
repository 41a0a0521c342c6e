"""deploy/docker-compose.yml (and the GPU override): checked without a Docker engine.

dclint validates both files against the Compose Specification's JSON schema and lints them. The
tests then read the file as compose would (YAML merge keys, ${VAR} interpolation from
deploy/env.example) and check that the services fit together: the files and folders it mounts
exist, the ports the API, Ray and Prometheus use agree, the checkpoint bucket the API uses is the
one the stack creates, and the API's ELASTRON_* variables are settings the control plane reads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from engine.jobspec import load_job
from tests.deploy.tools import ROOT, run

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
ENV_EXAMPLE = DEPLOY / "env.example"
SETTINGS = ROOT / "service" / "settings.py"

_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
    return env


def interpolate(value: Any, env: dict[str, str], missing: set[str]) -> Any:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, $VAR and $$ (a literal $). Names needed but absent from env go to `missing`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, missing) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, missing) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        present = name in env and (env[name] != "" or op not in {":-", ":?"})
        if present:
            return env[name]
        if op in {":-", "-"}:
            return arg
        missing.add(name)
        return ""

    return _VARIABLE.sub(substitute, value)


def load_compose(*paths: Path) -> dict[str, Any]:
    """The compose model after YAML merge keys, interpolation (from env.example) and merging the
    override files service by service."""
    env = read_env_file(ENV_EXAMPLE)
    missing: set[str] = set()
    model: dict[str, Any] = {}
    for path in paths:
        data = interpolate(yaml.safe_load(path.read_text()), env, missing)
        for key, value in data.items():
            if key == "services":
                services = model.setdefault("services", {})
                for name, service in value.items():
                    services[name] = {**services.get(name, {}), **service}
            else:
                model[key] = value
    assert not missing, f"variables without a default and not in {ENV_EXAMPLE.name}: {sorted(missing)}"
    return model


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_files_follow_the_compose_specification(dclint: Path) -> None:
    proc = run([dclint, "-c", DEPLOY / "dclint.yml", COMPOSE, COMPOSE_GPU])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "invalid-schema" not in proc.stdout


def test_dclint_rejects_a_file_that_breaks_the_schema(dclint: Path, tmp_path: Path) -> None:
    """The check above can fail: a misspelt service key is a schema error."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:\n", "    healthchek:\n", 1))
    proc = run([dclint, "-c", DEPLOY / "dclint.yml", broken])
    assert proc.returncode != 0 and "invalid-schema" in proc.stdout, proc.stdout


def test_the_stack_has_its_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {
        "ray-head",
        "ray-worker",
        "api",
        "minio",
        "create-bucket",
        "prometheus",
        "grafana",
    }


def test_every_variable_has_a_default_or_an_example() -> None:
    load_compose(COMPOSE, COMPOSE_GPU)  # raises on a variable nobody sets
    missing: set[str] = set()
    interpolate(yaml.safe_load(COMPOSE.read_text()), {}, missing)
    # the secrets have no default: compose refuses to start without them
    assert {"RAY_AUTH_TOKEN", "MINIO_ROOT_PASSWORD", "GRAFANA_ADMIN_PASSWORD"} <= missing


def test_dependencies_exist_and_wait_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        depends = (
            {d: {"condition": "service_started"} for d in depends} if isinstance(depends, list) else depends
        )
        for dependency, how in depends.items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{dependency} has no healthcheck"


def test_mounted_files_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).resolve().exists(), f"{name} mounts missing {source}"


def test_images_are_built_from_the_dockerfile(compose: dict[str, Any]) -> None:
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M | re.I))
    gpu = load_compose(COMPOSE, COMPOSE_GPU)
    for model in (compose, gpu):
        for name, service in model["services"].items():
            build = service.get("build")
            if build is None:
                continue
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT, name
            assert (context / build["dockerfile"]).is_file(), name
            assert build["target"] in stages, f"{name}: no stage {build['target']!r}"
    assert gpu["services"]["ray-worker"]["build"]["target"] == "gpu"
    devices = gpu["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_ray_nodes_stop_jobs_with_sigint_and_export_metrics(compose: dict[str, Any]) -> None:
    head, worker = compose["services"]["ray-head"], compose["services"]["ray-worker"]
    assert environment(head)["RAY_JOB_STOP_SIGNAL"] == "SIGINT"
    assert "--head" in head["command"]
    assert "--address=ray-head:6379" in worker["command"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    (ray,) = [job for job in scrape if job["job_name"] == "ray"]
    head_port = ray["static_configs"][0]["targets"][0].split(":")[1]
    assert f"--metrics-export-port={head_port}" in head["command"]
    assert f"--metrics-export-port={ray['dns_sd_configs'][0]['port']}" in worker["command"]
    assert ray["dns_sd_configs"][0]["names"] == ["ray-worker"]
    for node in (head, worker):
        env = environment(node)
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"]


def test_api_runs_the_app_factory_against_the_ray_head(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    command = api["command"]
    assert command[:3] == ["uvicorn", "--factory", "service.app:create_app"]
    port = command[command.index("--port") + 1]
    env = environment(api)
    ray_address = urlparse(env["ELASTRON_RAY_ADDRESS"])
    assert ray_address.hostname == "ray-head"
    assert f"--dashboard-port={ray_address.port}" in compose["services"]["ray-head"]["command"]
    assert urlparse(env["ELASTRON_API_URL"]).port == int(port)
    assert env["RAY_AUTH_TOKEN"] == environment(compose["services"]["ray-head"])["RAY_AUTH_TOKEN"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    (api_job,) = [job for job in scrape if job["job_name"] == "elastron-api"]
    assert api_job["static_configs"][0]["targets"] == [f"api:{port}"]


def settings_env_names() -> set[str]:
    """ELASTRON_* variables service/settings.py reads: its Settings fields with the env prefix."""
    tree = ast.parse(SETTINGS.read_text())
    (settings,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings"]
    prefix = re.search(r'env_prefix\s*=\s*"([^"]+)"', SETTINGS.read_text())
    assert prefix, "Settings has no env_prefix"
    fields = {
        n.target.id for n in settings.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    return {prefix.group(1) + f.upper() for f in fields if f != "model_config"}


def test_api_environment_names_are_control_plane_settings(compose: dict[str, Any]) -> None:
    names = {n for n in environment(compose["services"]["api"]) if n.startswith("ELASTRON_")}
    assert names and names - settings_env_names() == set()


def test_checkpoints_go_to_the_bucket_the_stack_creates(compose: dict[str, Any]) -> None:
    services = compose["services"]
    bucket = environment(services["create-bucket"])["CHECKPOINT_BUCKET"]
    api_env = environment(services["api"])
    assert urlparse(api_env["ELASTRON_CHECKPOINT_DIR"]).netloc == bucket
    for name in ("ray-head", "ray-worker", "api", "create-bucket"):
        env = environment(services[name])
        endpoint = urlparse(env["AWS_ENDPOINT_URL"])
        assert endpoint.hostname == "minio" and endpoint.port == 9000, name
        assert env["AWS_ACCESS_KEY_ID"] == environment(services["minio"])["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == environment(services["minio"])["MINIO_ROOT_PASSWORD"]
    example = load_job(DEPLOY / "examples" / "llama-tiny-s3.yaml")
    assert urlparse(example.checkpoint.path).netloc == bucket


def test_prometheus_and_grafana_read_the_files_in_deploy(compose: dict[str, Any]) -> None:
    services = compose["services"]
    mounts = {
        PurePosixPath(v.split(":")[1]): (DEPLOY / v.split(":")[0]).resolve()
        for name in ("prometheus", "grafana")
        for v in services[name]["volumes"]
        if v.startswith(".")
    }

    def host_path(container_path: str) -> Path:
        path = PurePosixPath(container_path)
        for target, source in mounts.items():
            if path == target or target in path.parents:
                return source / path.relative_to(target)
        raise AssertionError(f"{container_path} is not mounted from deploy/")

    config_flag = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    assert host_path(config_flag.split("=", 1)[1]) == DEPLOY / "prometheus" / "prometheus.yml"
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "elastron.yml").read_text()
    )
    assert host_path(provider["providers"][0]["options"]["path"]) == DEPLOY / "grafana" / "dashboards"
    assert host_path("/etc/grafana/provisioning") == DEPLOY / "grafana" / "provisioning"
    home = environment(services["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(home).is_file()


def test_prometheus_scrapes_the_api_with_its_metrics_token(compose: dict[str, Any]) -> None:
    """/metrics needs a token (ELASTRON_METRICS_TOKEN): the API gets it from METRICS_TOKEN and
    Prometheus reads the same variable from the file its scrape job names."""
    services = compose["services"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (api_job,) = [j for j in config["scrape_configs"] if j["job_name"] == "elastron-api"]
    assert api_job["authorization"]["type"] == "Bearer"
    (secret,) = services["prometheus"]["secrets"]
    assert api_job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    variable = compose["secrets"][secret]["environment"]
    token = environment(services["api"])["ELASTRON_METRICS_TOKEN"]
    assert token and token == read_env_file(ENV_EXAMPLE)[variable]
    missing: set[str] = set()
    interpolate(yaml.safe_load(COMPOSE.read_text()), {}, missing)
    assert variable in missing  # no default: compose refuses to start without one
