"""The docs a newcomer reads stay true (issue 62).

- README.md's "## Job file" section names every field of the job spec (`elastron schema`), the
  fields of its sub-sections too (model.moe, model.mla, model.rope_scaling, model.t5, model.lora,
  data.mlm: each is a section of its own in the file a user writes, so each of its fields is
  named, in a row of its own); and every `section.field` the docs name is a field.
- Every repository path README.md, docs/*.md and workers/README.md name exists, and README.md
  names every file of examples/.
- Every `elastron COMMAND [SUBCOMMAND]` they show is a command of the CLI, and the CLI modules'
  docstrings (elastron/cli.py, engine/cli.py) list every command.

Each check collects every problem (file and line where there is one) before it fails, and its
helper is also run on a fabricated text with a stale name, to show the check can fail. Seconds:
no torch and no Ray (the job spec and the typer apps import neither).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from engine.jobspec import json_schema

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def doc_files() -> list[Path]:
    """The docs these checks read: README.md, docs/*.md and workers/README.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "workers" / "README.md"]


def source(path: Path) -> str:
    return str(path.relative_to(ROOT))


# An inline code span; it may run over one line break (as Markdown allows), never over a blank line.
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\s*\n))+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line, code) for each line of a fenced code block and each inline code span, with the
    line it starts on."""
    prose: list[str] = []
    prose_start = 1

    def spans_of_prose() -> Iterator[tuple[int, str]]:
        block = "\n".join(prose)
        for match in CODE_SPAN.finditer(block):
            yield prose_start + block.count("\n", 0, match.start()), match.group(1)

    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            if not fenced:
                yield from spans_of_prose()
                prose = []
            fenced = not fenced
            prose_start = number + 1
        elif fenced:
            yield number, line
        else:
            prose.append(line)
    yield from spans_of_prose()


# --- the job file's fields -------------------------------------------------------------------------


def schema_paths(schema: dict) -> list[str]:
    """Every field path of the job spec: each top-level section (`model`, `name`, ...), each field
    of a section (`model.arch`), and, where a field is itself a section (an object of its own:
    `model.moe`, `model.mla`, `model.rope_scaling`, `model.t5`, `model.lora`, `data.mlm`), that
    sub-section and each of its fields (`model.moe.top_k`), at any depth."""
    defs = schema.get("$defs", {})

    def object_of(prop: dict) -> dict | None:
        for candidate in [prop, *prop.get("anyOf", []), *prop.get("allOf", [])]:
            ref = candidate.get("$ref")
            if ref:
                return defs[ref.rsplit("/", 1)[-1]]
        return None

    paths: list[str] = []

    def walk(obj: dict, prefix: str) -> None:
        for name, prop in obj.get("properties", {}).items():
            path = f"{prefix}{name}"
            paths.append(path)
            sub = object_of(prop)
            if sub is not None:
                walk(sub, f"{path}.")

    walk(schema, "")
    return paths


def markdown_section(text: str, heading: str) -> tuple[str, int]:
    """The text under `## heading` up to the next `## ` heading, and its first line's number."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end]), start + 1


TABLE_ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|(.*)$")


def documented_paths(section: str, sections: Iterable[str]) -> set[str]:
    """The field paths a Job file section names: a table row `| \\`P\\` | ... |` names P and, for
    each name N in backticks in its other cells, P.N (`| \\`model.moe\\` | \\`top_k\\` |` names
    model.moe.top_k); anywhere in the section, a dotted name in backticks that starts with a
    section (`\\`model.moe.top_k: 2\\``) names itself."""
    sections = set(sections)
    found: set[str] = set()
    for line in section.splitlines():
        row = TABLE_ROW.match(line)
        if row:
            parent, cells = row.groups()
            found.add(parent)
            for span in CODE_SPAN.findall(cells):
                found.update(f"{parent}.{name}" for name in DOTTED.findall(span))
    for _, span in code_spans(section):
        found.update(n for n in DOTTED.findall(span) if n.split(".", 1)[0] in sections)
    return found


def missing_fields(paths: Iterable[str], section: str) -> list[str]:
    """The paths `section` does not name, in schema order."""
    paths = list(paths)
    named = documented_paths(section, {p.split(".", 1)[0] for p in paths})
    return [p for p in paths if p not in named]


def job_file_section() -> tuple[str, int]:
    return markdown_section(README.read_text(), "Job file")


def test_job_file_section_names_every_field():
    """Every field path of `elastron schema` (sub-sections' fields included, e.g. model.moe.top_k
    and data.mlm.mask_prob) is named in README.md's "## Job file" section."""
    section, line = job_file_section()
    missing = missing_fields(schema_paths(json_schema()), section)
    assert not missing, (
        f"README.md:{line} (## Job file) does not name these job fields (in its table, or as "
        f"`section.field`): {', '.join(missing)}"
    )


def test_missing_field_check_can_fail():
    """The same helpers report a field the section does not name, and find nested ones."""
    section, _ = job_file_section()
    paths = schema_paths(json_schema())
    assert {"model.moe.top_k", "data.mlm.mask_prob", "model.lora.rank", "name"} <= set(paths)
    assert missing_fields([*paths, "model.no_such_field", "model.moe.no_such_knob"], section) == [
        "model.no_such_field",
        "model.moe.no_such_knob",
    ]
    fabricated = "| `model` | `arch`, `moe` |\n| `model.moe` | `top_k` |\nAlso `data.path`.\n"
    paths = ["model", "model.arch", "model.moe", "model.moe.top_k", "model.moe.top_p", "data.path", "data.split"]
    assert missing_fields(paths, fabricated) == ["model.moe.top_p", "data.split"]


# A dotted name that is a file (`model.safetensors`, `training.py`), not a field.
FILE_NAME = re.compile(r"\.(py|json|jsonl|yaml|yml|md|safetensors|txt|sh|bin|idx|toml)$")


def unknown_fields(text: str, source: str, paths: Iterable[str]) -> list[str]:
    """`section.field` names in code spans of `text` that are no field path of the schema."""
    paths = set(paths)
    sections = {p.split(".", 1)[0] for p in paths}
    return [
        f"{source}:{number}: {name}"
        for number, span in code_spans(text)
        for name in DOTTED.findall(span)
        if "." in name and name.split(".", 1)[0] in sections and name not in paths and not FILE_NAME.search(name)
    ]


def test_named_fields_exist():
    """Every `section.field` README.md, docs/*.md and workers/README.md name (`model.moe.top_k`,
    `checkpoint.local_interval`, ...) is a field of the job spec: a renamed field fails here."""
    paths = schema_paths(json_schema())
    problems = [p for doc in doc_files() for p in unknown_fields(doc.read_text(), source(doc), paths)]
    assert not problems, "job fields named in the docs that the job spec lacks:\n" + "\n".join(problems)


def test_unknown_field_check_can_fail():
    paths = schema_paths(json_schema())
    text = (
        "Set `model.moe.top_k: 2` and `training.train_iters`, in `model.safetensors` or `training.py`.\n"
        "Not `model.moe.topk` nor\n`checkpoint.every`; prose model.nothing is not code.\n"
    )
    assert unknown_fields(text, "fake.md", paths) == ["fake.md:2: model.moe.topk", "fake.md:3: checkpoint.every"]


# --- repository paths ------------------------------------------------------------------------------


def top_level_folders(root: Path = ROOT) -> list[str]:
    """The repository's top-level folders: not hidden and not ignored by the root .gitignore
    (build outputs such as build/, runs/ or *.egg-info/ are no part of a checkout)."""
    ignore_file = root / ".gitignore"
    ignored = [
        p.strip().strip("/")
        for p in (ignore_file.read_text().splitlines() if ignore_file.exists() else [])
        if p.strip() and not p.startswith("#")
    ]
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and not any(fnmatch.fnmatch(p.name, g) for g in ignored)
    )


def path_pattern(folders: Iterable[str]) -> re.Pattern[str]:
    """A top-level folder (not inside another path or a URL), a slash and the rest of the name."""
    alternatives = "|".join(re.escape(f) for f in sorted(folders, key=len, reverse=True))
    return re.compile(rf"(?<![\w./~$-])(?:{alternatives})/[^\s`'\"()\],;:|]*")


PLACEHOLDER = re.compile(r"[<>*?{}\[\]]|NNN")


def named_paths(text: str, folders: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line, path) for each repository path in `text` (prose, backticks, links, code blocks): a
    top-level folder, a slash, and a name ending in a file extension or in `/` (a folder).
    Placeholders (`<...>`, globs, NNN) are left out."""
    pattern = path_pattern(folders)
    for number, line in enumerate(text.splitlines(), start=1):
        for match in pattern.finditer(line):
            path = match.group(0).rstrip(".")
            if PLACEHOLDER.search(path):
                continue
            if path.endswith("/") or re.search(r"\.[A-Za-z0-9]+$", path.rsplit("/", 1)[-1]):
                yield number, path


def stale_paths(text: str, source: str, root: Path = ROOT) -> list[str]:
    folders = top_level_folders(root)
    return [f"{source}:{n}: {path}" for n, path in named_paths(text, folders) if not (root / path).exists()]


def test_named_repository_paths_exist():
    """Every repository file or folder README.md, docs/*.md and workers/README.md name exists."""
    problems = [p for doc in doc_files() for p in stale_paths(doc.read_text(), source(doc))]
    assert not problems, "paths named in the docs that do not exist:\n" + "\n".join(problems)


def test_stale_path_check_can_fail():
    """A fabricated text: the stale paths are reported with their lines; placeholders, globs,
    paths inside other paths and names with neither an extension nor a final / are not."""
    text = (
        "Run `engine/train_loop.py` and see [docs](docs/architecture.md).\n"
        "The job `examples/no_such_job.yaml` and engine/no_such_folder/.\n"
        "Not checked: runs/<id>/x.json, examples/*.yaml, iter_NNNNNNN, tests/engine, ../x/engine/y.py\n"
        "```bash\n.venv/bin/python bench/no_such_bench.py --smoke\n```\n"
    )
    assert "engine" in top_level_folders() and "build" not in top_level_folders()
    assert stale_paths(text, "fake.md") == [
        "fake.md:2: examples/no_such_job.yaml",
        "fake.md:2: engine/no_such_folder/",
        "fake.md:5: bench/no_such_bench.py",
    ]


def unnamed_files(text: str, folder: Path) -> list[str]:
    """The files of `folder` whose name `text` never mentions."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in text)


def test_readme_names_every_example():
    """README.md names every file in examples/ (a new example gets a line where a user finds it)."""
    missing = unnamed_files(README.read_text(), ROOT / "examples")
    assert not missing, f"README.md does not name these files of examples/: {', '.join(missing)}"


def test_unnamed_example_check_can_fail():
    assert "t5_tiny.yaml" in unnamed_files("`examples/bert_tiny.yaml`", ROOT / "examples")
    assert "bert_tiny.yaml" not in unnamed_files("`examples/bert_tiny.yaml`", ROOT / "examples")


# --- `elastron COMMAND` ----------------------------------------------------------------------------


def cli_commands(app) -> dict[str, set[str]]:
    """A typer app's commands as typer registers them, without running it: {command: its
    subcommands} (empty for a plain command)."""
    from typer.main import get_command

    group = get_command(app)
    return {name: set(getattr(cmd, "commands", {})) for name, cmd in group.commands.items()}


COMMAND = re.compile(r"(?<![\w.-])elastron\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?")


def unknown_commands(text: str, source: str, commands: dict[str, set[str]]) -> list[str]:
    """`elastron X [Y]` in code (spans and fenced blocks) whose X is no command, or whose X is a
    group that has no subcommand Y."""
    problems = []
    for number, code in code_spans(text):
        for match in COMMAND.finditer(code):
            name, sub = match.groups()
            if name not in commands:
                problems.append(f"{source}:{number}: elastron {name}")
            elif sub and commands[name] and sub not in commands[name]:
                problems.append(f"{source}:{number}: elastron {name} {sub}")
    return problems


def test_named_commands_exist():
    """Every `elastron COMMAND [SUBCOMMAND]` the docs show in code is registered on the composed
    `elastron` app (elastron/cli.py)."""
    from elastron.cli import app

    commands = cli_commands(app)
    problems = [p for doc in doc_files() for p in unknown_commands(doc.read_text(), source(doc), commands)]
    assert not problems, "commands named in the docs that the CLI lacks:\n" + "\n".join(problems)


def test_unknown_command_check_can_fail():
    from elastron.cli import app

    commands = cli_commands(app)
    assert {"train", "jobs", "tenants", "checkpoint", "worker-run"} <= set(commands)
    assert "export" in commands["jobs"]
    text = (
        "elastron validates it (prose, not code)\n"
        "`elastron train JOB` and `elastron jobs export <id> 5`\n"
        "```bash\n.venv/bin/elastron fly --high\nelastron tenants set-budget alice\n```\n"
        "`elastron tenants quota alice`, `elastron jobs [--state running]`, `elastron\n"
        "trian JOB` (a span over a line break)\n"
    )
    assert unknown_commands(text, "fake.md", commands) == [
        "fake.md:4: elastron fly",
        "fake.md:5: elastron tenants set-budget",
        "fake.md:7: elastron trian",
    ]


def unlisted_commands(doc: str, commands: dict[str, set[str]]) -> list[str]:
    """Commands (and a group's subcommands, as `group sub`) whose name `doc` does not contain as a
    word; a `group sub` in `doc` lists the subcommand, never a command of the same name."""
    tops = doc
    for name, subs in commands.items():
        for sub in subs:
            tops = re.sub(rf"(?<![\w-]){re.escape(name)}\s+{re.escape(sub)}(?![\w-])", name, tops)

    def listed(word: str, text: str) -> bool:
        return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None

    return [
        f"{name} {sub}".strip()
        for name, subs in commands.items()
        for sub in ["", *sorted(subs)]
        if not (listed(sub, doc) if sub else listed(name, tops))
    ]


def test_cli_docstrings_list_every_command():
    """elastron/cli.py's docstring names every command of `elastron`, engine/cli.py's every
    command of the engine's app, each group with each of its subcommands."""
    import elastron.cli
    import engine.cli

    problems = [
        f"{module.__file__}: {command}"
        for module in (elastron.cli, engine.cli)
        for command in unlisted_commands(module.__doc__ or "", cli_commands(module.app))
    ]
    assert not problems, "commands the CLI modules' docstrings do not list:\n" + "\n".join(problems)


def test_unlisted_command_check_can_fail():
    commands = {"train": set(), "export": set(), "jobs": {"export"}, "tenants": {"quota", "set-quota"}}
    doc = "Commands: train, jobs (and jobs export), tenants (quota). Not a word: pre-export."
    assert unlisted_commands(doc, commands) == ["export", "tenants set-quota"]
