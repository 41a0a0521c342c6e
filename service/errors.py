"""Error responses: what a caller got wrong is a 4xx naming the field and the fix; what we got
wrong is a 500 with a logged stack trace (and, where a job is concerned, a job event written by
the code that failed).

Job specifications are validated by the submission route with engine/jobspec/'s own
`parse_job` (service/submission.py), so the API answers with exactly the messages `elastron
train` prints (with "did you mean" for misspelt keys), one entry per problem; FastAPI itself
only checks that the body is a JSON object.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from service.submission import SpecProblem

log = logging.getLogger(__name__)


def problem_detail(
    problems: list[tuple[str, str]], prefix: tuple[str, ...] = ("body",)
) -> list[dict[str, Any]]:
    return [
        {
            "loc": [*prefix, *(p for p in field.replace("[", ".").replace("]", "").split(".") if p)],
            "msg": message,
            "type": "value_error",
        }
        for field, message in problems
    ]


def _plain(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in errors:
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        if e.get("type") == "json_invalid":
            msg = f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}"
        out.append(
            {
                "loc": [str(x) if not isinstance(x, int) else x for x in e.get("loc", ())],
                "msg": msg,
                "type": str(e.get("type", "value_error")),
            }
        )
    return out


def _job_spec_detail(body: Any, errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FastAPI refuses a submission only when its body is no JSON object (the route validates the
    spec itself)."""
    if any(e.get("type") == "json_invalid" for e in errors) or isinstance(body, dict):
        return _plain(errors)
    return [
        {
            "loc": ["body"],
            "type": "type_error",
            "msg": "the body must be a JSON object: a job specification (see `elastron schema` or /docs)",
        }
    ]


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    is_submission = request.method == "POST" and request.url.path.rstrip("/") == "/v1/jobs"
    if is_submission and any(tuple(e.get("loc", ()))[:1] == ("body",) for e in errors):
        detail = _job_spec_detail(exc.body, errors)
    else:
        detail = _plain(errors)
    return JSONResponse(status_code=422, content={"detail": detail})


async def spec_problem(_request: Request, exc: SpecProblem) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": problem_detail(exc.problems)})


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(status_code=500, content={"detail": "internal error (logged by the API)"})


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(SpecProblem, spec_problem)
    app.add_exception_handler(Exception, unexpected)
