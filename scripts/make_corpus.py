"""Regenerate engine/data/corpus/python_stdlib_docs.txt: the demo and test corpus.

It is the documentation text of a fixed list of Python standard-library modules (module,
class and function docstrings), which ships with every Python under the PSF licence: a small
real English/technical corpus that needs no download. Run with the project's Python 3.11.
"""

import importlib
import inspect
from pathlib import Path

MODULES = [
    "abc",
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "gzip",
    "hashlib",
    "heapq",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "wave",
    "zipfile",
]


def docs(module_name: str) -> list[str]:
    mod = importlib.import_module(module_name)
    out = [inspect.cleandoc(mod.__doc__)] if mod.__doc__ else []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        doc = inspect.getdoc(obj)
        if doc and len(doc) > 80:
            out.append(f"{name}: {doc}")
    return out


def main() -> None:
    parts = [text for m in MODULES for text in docs(m)]
    target = Path(__file__).resolve().parents[1] / "engine/data/corpus/python_stdlib_docs.txt"
    target.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {target} ({target.stat().st_size} bytes, {len(parts)} documents)")


if __name__ == "__main__":
    main()
