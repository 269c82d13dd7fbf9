"""Helpers for the metrics tests: scrape and read an exposition, list the metrics PromQL names."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "lockstep.json"
ALERTS = REPO / "deploy" / "helm" / "lockstep" / "files" / "alerts.yaml"

# Sample names a family of each type is exported under (text exposition).
_SUFFIXES = {
    "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"), "info": ("_info",), "gauge": ("",),
    "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "unknown": ("",),
}

# PromQL words that are not metric names.
_FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes",
    "clamp", "clamp_max", "clamp_min", "count", "count_over_time", "count_values", "delta",
    "deriv", "exp", "floor", "group", "histogram_quantile", "histogram_count", "histogram_sum",
    "histogram_fraction", "holt_winters", "idelta", "increase", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log2", "log10", "max", "max_over_time", "min",
    "min_over_time", "predict_linear", "present_over_time", "quantile", "quantile_over_time",
    "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev",
    "stddev_over_time", "stdvar", "stdvar_over_time", "sum", "sum_over_time", "time",
    "timestamp", "topk", "vector", "day_of_week", "hour", "minute", "month", "year",
}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan"}


def scrape(url: str) -> list[Metric]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def samples(families: Iterable[Metric], name: str, **labels: str) -> list[Any]:
    """Every sample called `name` whose labels include `labels`."""
    return [s for f in families for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def total(families: Iterable[Metric], name: str, **labels: str) -> float:
    return sum(s.value for s in samples(families, name, **labels))


def exported_names(families: Iterable[Metric]) -> set[str]:
    """Every series name the exposition declares (with a sample or not)."""
    names: set[str] = set()
    for family in families:
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana $variables allowed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    expr = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", "", expr)  # numbers
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word = match.group(0)
        if word in _FUNCTIONS or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries(board: dict[str, Any]) -> dict[str, str]:
    """"panel title #n" -> PromQL, for every panel target and every query variable."""
    queries = {}
    for panel in _panels(board.get("panels", [])):
        for i, target in enumerate(panel.get("targets", [])):
            if target.get("expr"):
                queries[f"{panel.get('title')} #{i}"] = target["expr"]
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            inner = re.search(r"label_values\((.*),\s*\w+\)\s*$", text)
            queries[f"${var.get('name')}"] = inner.group(1) if inner else text
    return queries


def alert_rules() -> list[dict[str, Any]]:
    import yaml

    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]
