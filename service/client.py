"""A small HTTP client for the REST API (what the `elastron` job commands use).

Where the API is and which token to use: ELASTRON_API_URL / ELASTRON_API_TOKEN, else the files
`elastron up` writes under ELASTRON_HOME (`api_url`, `token`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from service.settings import Settings


class ApiError(Exception):
    """A failed call, with a message meant for the person at the terminal."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ClientConfig:
    url: str
    token: str


def _read(path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def resolve_config(settings: Settings | None = None) -> ClientConfig:
    settings = settings or Settings()
    url = os.environ.get("ELASTRON_API_URL") or _read(settings.home / "api_url")
    token = os.environ.get("ELASTRON_API_TOKEN") or _read(settings.token_file)
    if not url:
        raise ApiError(
            f"no API address: set ELASTRON_API_URL, or start a local stack with `elastron up` "
            f"(it writes {settings.home / 'api_url'})"
        )
    if not token:
        raise ApiError(
            f"no API token: set ELASTRON_API_TOKEN (from `elastron token create --tenant NAME`), or start a "
            f"local stack with `elastron up` (it writes {settings.token_file})"
        )
    return ClientConfig(url=url.rstrip("/"), token=token)


def _explain(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text.strip() or None
    if isinstance(detail, list):
        lines = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(x) for x in item.get("loc", []) if x not in ("body", "query", "path"))
                msg = str(item.get("msg", item))
                lines.append(msg if not loc or msg.startswith(loc) else f"{loc}: {msg}")
            else:
                lines.append(str(item))
        detail = "\n".join(lines)
    return f"{detail or response.reason_phrase} (HTTP {response.status_code})"


class ApiClient:
    def __init__(self, config: ClientConfig, timeout_s: float = 30.0):
        self.config = config
        self._http = httpx.Client(
            base_url=config.url, timeout=timeout_s, headers={"Authorization": f"Bearer {config.token}"}
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise ApiError(
                f"cannot reach the API at {self.config.url}: {err} (is it running? `elastron up` starts one)"
            ) from None
        if response.status_code >= 400:
            raise ApiError(_explain(response), response.status_code)
        return response

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/jobs", json=spec, headers=headers).json()

    def jobs(self, state: str | None = None, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        params = {
            k: v for k, v in {"state": state, "limit": limit, "cursor": cursor}.items() if v is not None
        }
        return self._call("GET", "/v1/jobs", params=params).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def submit_sweep(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/sweeps", json=spec).json()

    def sweep(self, sweep_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/sweeps/{sweep_id}").json()

    def sweeps(self) -> dict[str, Any]:
        return self._call("GET", "/v1/sweeps").json()

    def extend_sweep(self, sweep_id: str, max_trials: int, resume_pruned: bool) -> dict[str, Any]:
        body = {"max_trials": max_trials, "resume_pruned": resume_pruned}
        return self._call("POST", f"/v1/sweeps/{sweep_id}/extend", json=body).json()

    def cancel_sweep(self, sweep_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/sweeps/{sweep_id}/cancel").json()

    def events(self, job_id: str, after: int = 0, limit: int = 500) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/events", params={"after": after, "limit": limit}).json()

    def metrics(self, job_id: str, after: int = -1, limit: int = 500) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/metrics", params={"after": after, "limit": limit}).json()

    def all_metrics(self, job_id: str) -> list[dict[str, Any]]:
        records, after = [], -1
        while True:
            page = self.metrics(job_id, after=after, limit=5000)
            records.extend(page["records"])
            if page["next_after"] is None:
                return records
            after = page["next_after"]

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/checkpoints").json()

    def export_checkpoint(
        self, job_id: str, iteration: int, output: str | None = None, dtype: str = "bf16", format: str = "hf"
    ) -> dict[str, Any]:
        body = {"format": format, "output": output, "dtype": dtype}
        return self._call("POST", f"/v1/jobs/{job_id}/checkpoints/{iteration}/export", json=body).json()

    def exports(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/exports").json()

    def export(self, job_id: str, export_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/exports/{export_id}").json()

    def queue(self) -> dict[str, Any]:
        return self._call("GET", "/v1/queue").json()

    def quota(self, tenant: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/tenants/{tenant}/quota").json()

    def set_quota(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PUT", f"/v1/tenants/{tenant}/quota", json=body).json()

    def logs(self, job_id: str) -> str:
        return self._call("GET", f"/v1/jobs/{job_id}/logs").text

    def follow_logs(self, job_id: str) -> Iterator[str]:
        try:
            with self._http.stream(
                "GET",
                f"/v1/jobs/{job_id}/logs",
                params={"follow": "true"},
                timeout=httpx.Timeout(30.0, read=None),
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(_explain(response), response.status_code)
                yield from response.iter_text()
        except httpx.TransportError as err:
            raise ApiError(f"the log stream from {self.config.url} broke off: {err}") from None
