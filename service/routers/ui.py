"""The web UI: static files shipped in the package, served by the API itself (no other server, no
build step, nothing fetched from a CDN: the page works offline). It reads the same /v1 API with
the same bearer token as every client, so it can show a tenant nothing the API would not.

Two small helpers it cannot do without: `/ui/config` (where the Ray dashboard and Grafana are,
for links, as the operator published them: ELASTRON_RAY_DASHBOARD_URL, ELASTRON_GRAFANA_URL; the
job states, which the page reads before its first view) and
`/ui/parse-job` (YAML to JSON: browsers have no YAML parser, and the job is then submitted to
`POST /v1/jobs` like any other, so its errors are the API's own). The parse reads aliases within
a bound (engine/jobspec/yaml_text.py), so its answer is at most the body's size plus that bound.
The pages' headers (CSP, no framing): service/surface_headers.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from engine.jobspec.yaml_text import load_yaml
from service.deps import Caller, Ctx
from service.states import FINAL, JobState

UI_DIR = Path(__file__).resolve().parents[1] / "ui"

router = APIRouter(tags=["ui"])
static = StaticFiles(directory=UI_DIR)


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/ui")


@router.get("/ui", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/ui/config", include_in_schema=False)
def ui_config(ctx: Ctx) -> dict[str, Any]:
    """Links, and the job states as service/states.py defines them (the page's filter, and which
    states end a job's refreshing), so the page never keeps a second list."""
    # ELASTRON_RAY_ADDRESS is how the API reaches Ray inside the cluster: never shown to browsers.
    return {
        "ray_dashboard_url": ctx.settings.ray_dashboard_url,
        "grafana_url": ctx.settings.grafana_url,
        "states": [str(s) for s in JobState],
        "final_states": [str(s) for s in JobState if s in FINAL],
    }


@router.post("/ui/parse-job", include_in_schema=False)
async def parse_job_file(request: Request, ctx: Ctx, caller: Caller) -> dict[str, Any]:
    """A job file's text (YAML or JSON) as the JSON object to submit; validation is the API's.
    The body is capped like every request (ELASTRON_MAX_BODY_BYTES), the rate per tenant
    (ELASTRON_PARSE_RATE_PER_MINUTE)."""
    await asyncio.to_thread(ctx.limits.enforce, caller.tenant, "parse", "parses job files")
    text = (await request.body()).decode("utf-8", errors="replace")
    try:
        data = load_yaml(text)  # aliases bounded: engine/jobspec/yaml_text.py
    except yaml.YAMLError as err:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, detail=f"the job file is not valid YAML: {err}"
        ) from None
    if not isinstance(data, dict):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail="a job file is a mapping with sections name, model, parallel, ...",
        )
    return {"spec": data}
