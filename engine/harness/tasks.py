"""Which lm-eval tasks an evaluation runs, checked before any rank starts.

A name is looked up in three places, in order: the tasks shipped here (tasks/*.yaml over local
JSON lines in tasks/data/, their relative data paths made absolute so they run from any
directory), the folders a user names (`--include-path`: their own task YAMLs), and lm-eval's own
registry (indexing it takes ~10 s, so only when a name is found nowhere else). A task runs only
when its rows are local files: our machines reach no hub, and a download that cannot happen
would surface as a long timeout inside `datasets`. So a task whose `dataset_path` is a hub name
(hellaswag's `Rowan/hellaswag`), a remote URL, or a data file that does not exist is refused
here, naming the task and the way to point it at local files (docs/evaluation.md).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).parent / "tasks"
LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow"}  # datasets' packaged builders: read files only
HUB_HINT = (
    "our machines reach no hub: copy the task's YAML into a folder of your own with dataset_path: json and "
    "dataset_kwargs.data_files naming local files, and pass that folder with --include-path (docs/evaluation.md)"
)


class TaskError(ValueError):
    """A task that cannot run here; the message names it and what to do."""


@dataclass(frozen=True)
class ResolvedTasks:
    """What every rank hands to lm-eval: `specs` (config dicts of shipped tasks, names of the
    others), the user's task folders and whether lm-eval's registry is needed to build them."""

    specs: list[str | dict[str, Any]]
    include_paths: list[str] = field(default_factory=list)
    registry: bool = False

    def task_manager(self):
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=self.include_paths or None, include_defaults=self.registry)


def shipped_tasks() -> dict[str, dict[str, Any]]:
    """name -> config of the tasks shipped in tasks/, data paths absolute."""
    found = {}
    for path in sorted(SHIPPED.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        config["dataset_kwargs"]["data_files"] = {split: str(SHIPPED / f) for split, f in files.items()}
        found[config["task"]] = config
    return found


def resolve_tasks(names: list[str], include_paths: list[str] | None = None) -> ResolvedTasks:
    """The tasks `names` as lm-eval will load them; TaskError for an unknown task or one whose
    data is not on local files."""
    if not names:
        raise TaskError("--tasks: name at least one task (shipped: " + ", ".join(sorted(shipped_tasks())) + ")")
    include = [str(Path(p).resolve()) for p in include_paths or []]
    for folder in include:
        if not Path(folder).is_dir():
            raise TaskError(f"--include-path {folder}: no such folder")
    shipped = shipped_tasks()
    rest = [n for n in names if n not in shipped]
    manager, registry = None, False
    if rest:
        from lm_eval.tasks import TaskManager

        if include:
            manager = TaskManager(include_path=include, include_defaults=False)
        if manager is None or any(n not in manager.task_index for n in rest):
            manager, registry = TaskManager(include_path=include or None), True
        for name in rest:
            _check_local(name, manager, seen=set())
    specs = [shipped[n] if n in shipped else n for n in names]
    return ResolvedTasks(specs, include, registry)


def _check_local(name: str, manager, seen: set[str]) -> None:
    """TaskError unless task (or group, or tag) `name` reads local files only."""
    index = manager.task_index
    entry = index.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, [*shipped_tasks(), *index], n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise TaskError(f"--tasks: unknown task {name!r}{hint}")
    if name in seen:
        return
    seen.add(name)
    kind = getattr(entry.kind, "name", str(entry.kind))
    config = entry.cfg or {}
    if kind == "TAG":
        for child, other in index.items():
            if name in other.tags:
                _check_local(child, manager, seen)
        return
    if kind == "GROUP":
        for child in config.get("task", []):
            if isinstance(child, str):
                _check_local(child, manager, seen)
            elif isinstance(child, dict) and "task" in child:
                _check_data(str(child["task"]), child)
        return
    if kind == "PY_TASK" or not config:
        raise TaskError(f"--tasks: {name!r} is defined in Python, not by a task YAML over local files; {HUB_HINT}")
    _check_data(name, config)


def _check_data(name: str, config: dict[str, Any]) -> None:
    path = config.get("dataset_path")
    if "custom_dataset" in config:  # the task's own loader (the user's code in their folder)
        return
    if path is None:
        raise TaskError(f"--tasks: {name!r} names no dataset_path; {HUB_HINT}")
    if path not in LOCAL_BUILDERS:
        if Path(path).is_dir():
            return
        raise TaskError(f"--tasks: {name!r} reads dataset {path!r} from the Hugging Face Hub; {HUB_HINT}")
    kwargs = config.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if not files:
        raise TaskError(f"--tasks: {name!r} (dataset_path: {path}) names no dataset_kwargs.data_files")
    listed = files.values() if isinstance(files, dict) else [files]
    for entry in listed:
        for f in entry if isinstance(entry, list) else [entry]:
            if "://" in str(f):
                raise TaskError(f"--tasks: {name!r} reads {f}, a remote file; {HUB_HINT}")
            if not Path(f).is_file():
                raise TaskError(
                    f"--tasks: {name!r}: data file {f} does not exist (a relative path is read from the "
                    "current directory; write an absolute one)"
                )
