"""Checkpoint exports: which folder is read, where the result may go, the command that runs.

The export itself is `elastron export` (engine/cli.py), run as its own launcher submission (a
Ray job) by the reconciler: it reads the whole checkpoint and can take minutes, so never in a
request, and it runs with the service's rights. Hence:
- the checkpoint read is the one the job's spec as run says it writes,
  `<checkpoint.path>/<job id>/<name>/iter_NNNNNNN` (engine/jobspec/layout.py, as for
  `resume_from: job:ID`), never the uri a telemetry batch carried: a job token cannot point an
  export at another tenant's files;
- the output is an s3:// URI under the tenant's storage roots (service/storage_policy.py; any
  bucket for an admin), or an absolute local path under the tenant's granted roots or the job's tenant's folders of
  this service: `<ELASTRON_CHECKPOINT_DIR>/<tenant>/` (when that is local) and
  `<ELASTRON_HOME>/exports/<tenant>/`, never inside a checkpoint's `iter_` folder; by default
  `<checkpoint folder>-hf`, beside the checkpoint (where every node that reads it can write);
- the checkpoint is the command's last argument, after `--`, so no reported name is an option.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

from engine.jobspec.layout import (
    ITERATION_FOLDER,
    checkpoint_location,
    iteration_folder,
    job_checkpoint_path,
    join_location,
)
from engine.jobspec.storage_roots import StorageRoots, normalize, outside_message
from service.settings import Settings

_S3 = re.compile(r"^s3://[A-Za-z0-9._-]{1,255}(/.*)?$")


class OutputProblem(ValueError):
    """An `output` the service will not write to; the message names the fix."""


def checkpoint_folder(spec: dict[str, Any], job_id: str, iteration: int) -> str | None:
    """Where the job wrote its checkpoint of `iteration`; None for a job without checkpoint.path."""
    root = (spec.get("checkpoint") or {}).get("path")
    if not root:
        return None
    return join_location(
        checkpoint_location(job_checkpoint_path(root, job_id), spec["name"]), iteration_folder(iteration)
    )


def local_roots(settings: Settings, tenant: str) -> list[str]:
    roots = [os.path.abspath(settings.exports_dir / tenant)]
    checkpoints = settings.resolved_checkpoint_dir
    if "://" not in checkpoints:
        roots.insert(0, os.path.abspath(os.path.join(checkpoints, tenant)))
    return roots


# REST format -> `elastron export` flags (a LoRA job's merged model is --format hf --merge-lora).
FORMAT_FLAGS = {"hf": ["--format", "hf"], "peft": ["--format", "peft"], "hf-merged-lora": ["--format", "hf", "--merge-lora"]}
LORA_FORMATS = ("peft", "hf-merged-lora")


def format_problem(spec: dict[str, Any], format: str) -> str | None:
    """Why `format` does not fit the job (None: it does): a LoRA job's checkpoint holds adapters
    only, any other job's has none."""
    lora = (spec.get("model") or {}).get("lora") is not None
    if lora and format not in LORA_FORMATS:
        return (
            f"format {format!r}: this job trained LoRA adapters (model.lora), its checkpoints hold no whole model: "
            "use format peft (the adapters) or hf-merged-lora (the base with them merged in)"
        )
    if not lora and format in LORA_FORMATS:
        return f"format {format!r} exports LoRA adapters, and this job has none (no model.lora): use format hf"
    return None


def resolve_output(
    output: str | None,
    source: str,
    settings: Settings,
    tenant: str,
    format: str = "hf",
    allowed: StorageRoots | None = None,
) -> str:
    """The export's destination: `output` if the service may write there, else OutputProblem.
    `allowed`: the tenant's storage roots (service/storage_policy.py; None for an admin), which
    an s3:// output must be under, and which extend the local folders by the tenant's grants."""
    if output is None:
        return f"{source.rstrip('/')}-{format}"
    if output.startswith("s3://"):
        if not _S3.match(output) or "/../" in f"{output}/" or normalize(output) is None:
            raise OutputProblem(f"output {output!r} is not an s3://bucket/prefix URI")
        if any(ITERATION_FOLDER.match(part) for part in output[5:].split("/")):
            raise OutputProblem(
                f"output {output!r} is inside a checkpoint's iter_ folder: choose another prefix"
            )
        if allowed is not None and not allowed.allows(output, "write"):
            raise OutputProblem(outside_message("output", output, allowed, "write"))
        return output.rstrip("/")
    roots = local_roots(settings, tenant)
    if allowed is not None:  # the tenant's granted local roots too
        roots += [r for r in allowed.write if r.startswith("/") and r not in roots]
    shown = " or ".join(f"{r}/" for r in roots)
    if "://" in output or not output.startswith("/"):
        raise OutputProblem(f"output {output!r}: give an s3:// URI or an absolute local path under {shown}")
    path = PurePosixPath(os.path.realpath(output))  # `..` and symlinks: where it really leads
    real = [PurePosixPath(os.path.realpath(r)) for r in roots]
    if not any(path != r and path.is_relative_to(r) for r in real):
        raise OutputProblem(
            f"output {output!r} is outside this tenant's folders of the service: the export runs with the "
            f"service's rights, so a local output must be under {shown} (or use an s3:// URI under the "
            "tenant's storage roots)"
        )
    if any(ITERATION_FOLDER.match(part) for part in path.parts):
        raise OutputProblem(f"output {output!r} is inside a checkpoint's iter_ folder: choose another folder")
    return str(path)


def export_command(
    settings: Settings, *, source: str, output: str, format: str, dtype: str, endpoint_url: str | None
) -> list[str]:
    """`elastron export --format F [--merge-lora] --output O --dtype D [--endpoint-url U] -- CHECKPOINT`."""
    argv = [
        *shlex.split(settings.export_entrypoint),
        *FORMAT_FLAGS[format],
        "--output",
        output,
        "--dtype",
        dtype,
    ]
    if endpoint_url:
        argv += ["--endpoint-url", endpoint_url]
    return [*argv, "--", source]
