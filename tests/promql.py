"""Helpers for the metrics tests: scrape and read an exposition, read the dashboard and the alert
rules, and list the metrics a PromQL expression selects (parsed by promql-parser)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import promql_parser
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "lockstep.json"
ALERTS = REPO / "deploy" / "helm" / "lockstep" / "files" / "alerts.yaml"

# Sample names a family of each type is exported under (text exposition).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "gauge": ("",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}

# What Grafana substitutes before a query reaches Prometheus (values for a 1 s scrape interval).
GRAFANA_VARIABLES = {"$__rate_interval": "4s", "$owner": ".*"}


def scrape(url: str) -> list[Metric]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def samples(families: Iterable[Metric], name: str, **labels: str) -> list[Any]:
    """Every sample called `name` whose labels include `labels`."""
    return [
        s
        for f in families
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(families: Iterable[Metric], name: str, **labels: str) -> float:
    return sum(s.value for s in samples(families, name, **labels))


def exported_names(families: Iterable[Metric]) -> set[str]:
    """Every series name the exposition declares (with a sample or not)."""
    names: set[str] = set()
    for family in families:
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def grafana_to_promql(expr: str) -> str:
    """The query Prometheus receives once Grafana has filled in the dashboard's variables."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, from Prometheus' grammar (promql-parser)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            return
        if isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, promql_parser.BinaryExpr):
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                walk(arg)
        elif isinstance(node, promql_parser.AggregateExpr):
            walk(node.expr)
            if node.param is not None:
                walk(node.param)
        elif isinstance(node, promql_parser.ParenExpr | promql_parser.SubqueryExpr):
            walk(node.expr)
        elif isinstance(node, promql_parser.UnaryExpr):
            walk(node.expr)

    walk(promql_parser.parse(grafana_to_promql(expr)))
    return names


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries(board: dict[str, Any]) -> dict[str, str]:
    """ "panel title #n" -> PromQL, for every panel target and every query variable."""
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
