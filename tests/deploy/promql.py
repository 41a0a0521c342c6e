"""What the deploy tests need to read PromQL and service/METRICS.md.

- `load_metrics_contract()` parses METRICS.md's table into the metric names the API exports (with
  the series names a histogram or counter really exposes), their labels and, where METRICS.md
  lists them, the values a label takes.
- `selectors()` pulls every metric selector (name and label matchers) and every grouping label
  (`by`, `without`, `on`, `ignoring`, `group_left/right`) out of a PromQL expression.
  Whether an expression is valid PromQL is promtool's job (the tests run `promtool check rules` on
  a rules file built from the expressions); this only has to find names in valid expressions.
- `unknown_names()` checks an expression against the contract and returns what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS_MD = ROOT / "service" / "METRICS.md"

# NVIDIA DCGM exporter: the fields the Training dashboard's GPU row reads, and the labels the
# exporter puts on every series.
DCGM_METRICS = {
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
}
DCGM_LABELS = {
    "gpu",
    "UUID",
    "device",
    "modelName",
    "Hostname",
    "pci_bus_id",
    "namespace",
    "pod",
    "container",
}

# Series Prometheus writes itself for every target.
PROMETHEUS_BUILTINS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Labels every scraped series has (target labels; `pod` where the chart's ServiceMonitor scrapes).
TARGET_LABELS = {"job", "instance", "pod"}
# Labels the elastron API puts on every per-job series (METRICS.md's preamble).
PER_JOB_LABELS = {"job", "tenant"}

AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
}
CONSTANTS = {"inf", "nan", "Inf", "NaN"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}

GRAFANA_DURATIONS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


@dataclass
class Metric:
    name: str
    type: str
    labels: set[str]
    # Series names as scraped: a histogram exposes _bucket/_sum/_count, a counter also _created.
    series: set[str] = field(default_factory=set)


@dataclass
class Contract:
    metrics: dict[str, Metric]
    label_values: dict[str, set[str]]  # label -> values METRICS.md lists for it

    def series_names(self) -> dict[str, Metric]:
        return {series: metric for metric in self.metrics.values() for series in metric.series}


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def load_metrics_contract(path: Path = METRICS_MD) -> Contract:
    """Parses the table of METRICS.md: | `name` | type | extra labels | from |."""
    metrics: dict[str, Metric] = {}
    label_values: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`elastron_"):
            continue
        name = cells[0].strip("`")
        kind = cells[1].lower()
        assert kind in {"gauge", "counter", "histogram"}, f"METRICS.md: unknown type {kind!r} for {name}"
        # "`phase`, `stat` (`min`/`max`)": labels outside parentheses, listed values inside.
        extra_labels = _backticked(re.sub(r"\([^)]*\)", "", cells[2]))
        listed = dict(re.findall(r"`(\w+)`\s*\(([^)]*)\)", cells[2]))
        for label, values in listed.items():
            label_values.setdefault(label, set()).update(_backticked(values))
        # The one extra label without values of its own, when the description lists values in
        # parentheses: "engine timers (data, forward, ...)", "jobs in each state (queued, ...)".
        described = re.search(r"\(([a-z_\-]+(?:,\s*[a-z_\-]+)+)\)", cells[3])
        unlisted = [label for label in extra_labels if label not in listed]
        if len(unlisted) == 1 and described:
            label_values.setdefault(unlisted[0], set()).update(
                v.strip() for v in described.group(1).split(",")
            )
        labels = set(extra_labels) | TARGET_LABELS
        if name.startswith("elastron_job_"):
            labels |= PER_JOB_LABELS
        if kind == "histogram":
            series = {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "counter":
            series = {name, name.removesuffix("_total") + "_created"}
        else:
            series = {name}
        metrics[name] = Metric(name, kind, labels, series)
    assert metrics, f"no metrics table found in {path}"
    return Contract(metrics, label_values)


# --- PromQL scanning ---------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w.]))
  | (?P<number>0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=@,(){}\[\]])
    """,
    re.VERBOSE,
)


@dataclass
class Selector:
    metric: str | None
    matchers: list[tuple[str, str, str]]  # (label, operator, value)


@dataclass
class Scan:
    selectors: list[Selector]
    grouping_labels: set[str]


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot read PromQL at {expr[pos : pos + 20]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            tokens.append((kind, m.group()))
    return tokens


def _read_matchers(tokens: list[tuple[str, str]], i: int) -> tuple[list[tuple[str, str, str]], int]:
    """Reads `{label op "value", ...}` starting at the `{` at i; returns the matchers and the index
    after the `}`."""
    assert tokens[i][1] == "{"
    i += 1
    matchers = []
    while tokens[i][1] != "}":
        if tokens[i][1] == ",":
            i += 1
            continue
        label, op, value = tokens[i][1], tokens[i + 1][1], tokens[i + 2][1]
        matchers.append((label, op, value[1:-1]))
        i += 3
    return matchers, i + 1


def scan(expr: str) -> Scan:
    """Finds the metric selectors and grouping labels of a (valid) PromQL expression."""
    tokens = tokenize(expr)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "ident" and text in GROUPING and following == "(":
            j = i + 2
            while tokens[j][1] != ")":
                if tokens[j][0] == "ident":
                    grouping.add(tokens[j][1])
                j += 1
            i = j + 1
            continue
        if kind == "op" and text == "[":  # a range or subquery: skip to its end
            while tokens[i][1] != "]":
                i += 1
            i += 1
            continue
        if kind == "op" and text == "{":  # a selector without a metric name
            matchers, i = _read_matchers(tokens, i)
            selectors.append(Selector(None, matchers))
            continue
        if kind == "ident":
            if following == "(" or text in AGGREGATIONS or text in KEYWORDS or text in CONSTANTS:
                i += 1
                continue
            if following == "{":
                matchers, i = _read_matchers(tokens, i + 1)
            else:
                matchers, i = [], i + 1
            selectors.append(Selector(text, matchers))
            continue
        i += 1
    return Scan(selectors, grouping)


def substitute_grafana_variables(expr: str, variables: set[str]) -> str:
    """Replaces Grafana's interval variables with durations and the dashboard's own variables
    with a plain value, so the expression is PromQL. An undefined `$name` raises."""
    for name, duration in GRAFANA_DURATIONS.items():
        expr = expr.replace(name, duration)
    for ref in re.findall(r"\$\{?(\w+)(?::\w+)?\}?", expr):
        if ref not in variables:
            raise ValueError(f"undefined dashboard variable ${ref} in {expr!r}")
    return re.sub(r"\$\{?(\w+)(?::\w+)?\}?", "value", expr)


def label_values_query(query: str) -> tuple[str, str]:
    """Splits Grafana's `label_values(selector, label)` into the selector and the label."""
    m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", query)
    if not m:
        raise ValueError(f"not a label_values() query: {query!r}")
    return m.group(1), m.group(2)


def unknown_names(expr: str, contract: Contract, recording_rules: dict[str, set[str]]) -> list[str]:
    """Every problem with the names in `expr`: metric names that are neither in METRICS.md, a
    recording rule, DCGM's nor Prometheus's own; label names a metric does not carry; and label
    values METRICS.md does not list. `recording_rules` maps each rule name to its labels."""
    problems: list[str] = []
    series = contract.series_names()
    result = scan(expr)
    labels_in_expr: set[str] = set(TARGET_LABELS)
    for sel in result.selectors:
        if sel.metric is None:
            problems.append(f"selector without a metric name: {sel.matchers}")
            continue
        if sel.metric in series:
            metric = series[sel.metric]
            allowed = metric.labels | ({"le"} if sel.metric.endswith("_bucket") else set())
        elif sel.metric in recording_rules:
            allowed = recording_rules[sel.metric]
        elif sel.metric in DCGM_METRICS:
            allowed = DCGM_LABELS | TARGET_LABELS
        elif sel.metric in PROMETHEUS_BUILTINS:
            allowed = set(TARGET_LABELS)
        else:
            problems.append(f"unknown metric {sel.metric}")
            continue
        labels_in_expr |= allowed
        for label, op, value in sel.matchers:
            if label not in allowed:
                problems.append(f"{sel.metric} has no label {label!r} (it has {sorted(allowed)})")
            elif op in {"=", "!="} and label in contract.label_values and sel.metric not in DCGM_METRICS:
                if value not in contract.label_values[label] and value != "value":
                    problems.append(
                        f"{sel.metric}{{{label}{op}{value!r}}}: METRICS.md lists {sorted(contract.label_values[label])}"
                    )
    for label in result.grouping_labels - labels_in_expr - {"le"}:
        problems.append(f"grouping label {label!r} is on none of the expression's metrics")
    return problems


def recording_rule_labels(groups: list[dict], contract: Contract) -> dict[str, set[str]]:
    """The labels each recording rule's series carry: the `by (...)` of its outermost
    aggregation if it has one, else the labels of the metrics it reads."""
    rules: dict[str, set[str]] = {}
    for group in groups:
        for rule in group["rules"]:
            if "record" not in rule:
                continue
            expr = rule["expr"].strip()
            m = re.match(r"(?:sum|max|min|avg|count)\s+by\s*\(([^)]*)\)", expr)
            if m:
                labels = {label.strip() for label in m.group(1).split(",") if label.strip()}
            else:
                labels = set()
                series = contract.series_names()
                for sel in scan(expr).selectors:
                    if sel.metric in series:
                        labels |= series[sel.metric].labels
            rules[rule["record"]] = labels | set(rule.get("labels", {}))
    return rules
