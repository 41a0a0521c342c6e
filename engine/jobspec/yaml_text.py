"""YAML job files read with bounded work: the one YAML reader of the job specification.

`yaml.safe_load` expands aliases (`*name`) without limit: nine levels of nine aliases (the
"billion laughs", 342 bytes) make a document of 9**9 nodes. PyYAML shares an aliased node
instead of copying it, so loading is cheap, but whatever walks the result afterwards (pydantic
validation, the JSON of `/ui/parse-job`'s response) pays for every expansion: the service once
answered such a document with 2.7 GB. Every reader of job files (the engine's `load_job`, the
CLI, the web UI's parse route) therefore goes through `load_yaml`, which measures the document as
it would be expanded (each node once, each scalar by its length, an alias by what it stands for)
before anything is built from it, and refuses a document whose aliases add more than
`ALIAS_BUDGET` to its own size, or that refers to itself (a recursive alias), or that nests
deeper than Python's recursion allows. Aliases within the budget (a shared `&defaults` block)
keep working. The refusals are `yaml.YAMLError`s, so callers report them like any YAML error.
"""

from __future__ import annotations

from typing import Any

import yaml

# Size units an alias expansion may add beyond the document's own length: a scalar counts its
# length plus one, a mapping or sequence one plus its entries. A job file is a few hundred units.
ALIAS_BUDGET = 100_000


class YamlRefused(yaml.YAMLError):
    """A YAML document refused before it is built: too large once expanded, or recursive."""


def expanded_size(root: yaml.Node) -> int:
    """The size of the document `root` once every alias is replaced by what it stands for; a
    node reached again while it is being measured (a recursive alias) raises YamlRefused."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise YamlRefused(
                f"a recursive alias (an anchor used inside itself) {node.start_mark}: "
                "a job file is a tree; write the value out"
            )
        if isinstance(node, yaml.ScalarNode):
            total = 1 + len(node.value)
        else:
            open_nodes.add(key)
            if isinstance(node, yaml.MappingNode):
                total = 1 + sum(size(k) + size(v) for k, v in node.value)
            else:
                total = 1 + sum(size(item) for item in node.value)
            open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that measures the composed document before constructing Python objects."""

    limit: int = ALIAS_BUDGET

    def construct_document(self, node: yaml.Node) -> Any:
        total = expanded_size(node)
        if total > self.limit:
            raise YamlRefused(
                f"the document's aliases (*name) expand it to {total} units, more than the "
                f"{self.limit} a job file may reach: write the repeated sections out instead of "
                "repeating anchors"
            )
        return super().construct_document(node)


def load_yaml(text: str, alias_budget: int = ALIAS_BUDGET) -> Any:
    """`yaml.safe_load(text)` with the expanded document bounded by `len(text) + alias_budget`
    size units (see the module docstring); raises yaml.YAMLError (YamlRefused) otherwise."""
    loader = _BoundedLoader(text)
    loader.limit = len(text) + alias_budget
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YamlRefused("the document nests deeper than a job file can: flatten it") from None
    finally:
        loader.dispose()
