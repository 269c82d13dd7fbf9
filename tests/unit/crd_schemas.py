"""JSON schemas for the two prometheus-operator kinds the chart renders (monitoring.coreos.com/v1
ServiceMonitor and PrometheusRule): kubernetes-validate bundles only the built-in kinds.

Written from the CRDs' field names and types, for the fields a chart would set; anything else
is refused (additionalProperties: false), so a typo in a template fails the test.
"""

from __future__ import annotations

from typing import Any

DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
    r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
NAME = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": NAME, "namespace": NAME, "labels": STRMAP, "annotations": STRMAP},
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRMAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}


def _kind(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


SERVICE_MONITOR = _kind(
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "additionalProperties": False,
        "properties": {
            "jobLabel": {"type": "string"},
            "targetLabels": {"type": "array", "items": {"type": "string"}},
            "selector": LABEL_SELECTOR,
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
            },
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "honorLabels": {"type": "boolean"},
                        "honorTimestamps": {"type": "boolean"},
                        "params": {"type": "object"},
                        "relabelings": {"type": "array", "items": {"type": "object"}},
                        "metricRelabelings": {"type": "array", "items": {"type": "object"}},
                    },
                },
            },
        },
    },
)

PROMETHEUS_RULE = _kind(
    "PrometheusRule",
    {
        "type": "object",
        "required": ["groups"],
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "rules"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "limit": {"type": "integer"},
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["expr"],
                                "additionalProperties": False,
                                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                "properties": {
                                    "alert": {
                                        "type": "string",
                                        "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$",
                                    },
                                    "record": {"type": "string"},
                                    "expr": {"type": ["string", "integer"], "minLength": 1},
                                    "for": DURATION,
                                    "keep_firing_for": DURATION,
                                    "labels": STRMAP,
                                    "annotations": STRMAP,
                                },
                            },
                        },
                    },
                },
            }
        },
    },
)

SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}
