"""The Helm chart (deploy/helm/lockstep), rendered by Helm's own engine and validated offline.

Rendering and linting use `helm-python-sdk`: Helm's Go SDK (the code behind `helm template` and
`helm lint`) built as a C library inside the wheel, so no helm binary is downloaded. Rendered
manifests are checked against the Kubernetes JSON schemas bundled in `kubernetes-validate`
(strict: unknown fields fail) and the prometheus-operator kinds against `crd_schemas`; values
against values.schema.json. The rendered commands are parsed by the real CLIs they invoke.
"""

from __future__ import annotations

import copy
import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from lockstep.gateway.__main__ import build_parser as gateway_parser
from lockstep.scheduler.server import parse_args as scheduler_args
from tests.promql import ALERTS

from .crd_schemas import SCHEMAS

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "lockstep"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version() + ".0")
VALUE_SETS = {"default": {}, "gpu": yaml.safe_load(GPU_VALUES.read_text())}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="lockstep", namespace="ml", is_install=True)
    return [
        doc
        for path, text in sorted(out.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def manifests(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(VALUE_SETS[request.param])


def find(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    hits = [
        d
        for d in docs
        if d["kind"] == kind
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(hits) == 1, (kind, component, len(hits))
    return hits[0]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d


def test_chart_lints_clean() -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(CHART, values, strict=True)
        assert not report["errors"], report
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems, problems


def test_manifests_validate_against_kubernetes_schemas(manifests: list[dict[str, Any]]) -> None:
    for doc in manifests:
        if doc["kind"] in SCHEMAS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_default_values_render_the_whole_service() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in render({}))
    assert kinds == sorted(
        [
            ("ConfigMap", "lockstep-redis"),
            ("Deployment", "lockstep-gateway"),
            ("PersistentVolumeClaim", "lockstep-data"),
            ("PodDisruptionBudget", "lockstep-gateway"),
            ("Secret", "lockstep-api-keys"),
            ("Secret", "lockstep-file-url"),
            ("Secret", "lockstep-redis"),
            ("Service", "lockstep-gateway"),
            ("Service", "lockstep-redis"),
            ("Service", "lockstep-scheduler"),
            ("ServiceAccount", "lockstep"),
            ("StatefulSet", "lockstep-redis"),
            ("StatefulSet", "lockstep-scheduler"),
        ]
    )


def test_gpu_values_put_the_worker_group_on_gpu_nodes() -> None:
    docs = render(VALUE_SETS["gpu"])
    pod = find(docs, "StatefulSet", "scheduler")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["memory"] == "96Gi"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["runtimeClassName"] == "nvidia"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    sglang = find(docs, "Deployment", "sglang")["spec"]["template"]["spec"]
    assert sglang["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sglang["tolerations"] == pod["tolerations"]
    assert not [
        d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"
    ], "external Redis: nothing bundled"
    env = {e["name"]: e for e in container["env"]}
    assert env["LOCKSTEP_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "lockstep-redis"
    gateway = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    assert "affinity" not in gateway, "ReadWriteMany data: the gateway may run anywhere"
    ingress = find(docs, "Ingress", "gateway")
    paths = [p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]]
    assert paths == ["/api/v1", "/oai/api/v1", "/anthropic/api/v1"]


def test_rendered_commands_parse_with_the_real_clis(manifests: list[dict[str, Any]]) -> None:
    sched = find(manifests, "StatefulSet", "scheduler")["spec"]["template"]["spec"]
    container = sched["containers"][0]
    assert container["command"] == ["python", "-m", "lockstep.scheduler"]
    cfg = scheduler_args(
        [a.replace("$(LOCKSTEP_REDIS_URL)", "redis://r:6379/0") for a in container["args"]]
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert cfg.metrics_port == ports["metrics"] and cfg.metrics_host == "0.0.0.0"
    assert cfg.listen.endswith(f":{ports['grpc']}")
    assert str(cfg.data_dir) == "/data"
    gateway = find(manifests, "Deployment", "gateway")["spec"]["template"]["spec"]
    gw = gateway["containers"][0]
    assert gw["command"] == ["python", "-m", "lockstep.gateway"]
    args = gateway_parser().parse_args(gw["args"])
    assert args.scheduler == f"lockstep-scheduler:{ports['grpc']}"
    mounts = {m["mountPath"] for m in gw["volumeMounts"]}
    assert str(args.api_keys_file.parent) in mounts
    assert str(args.file_url_secret_file.parent) in mounts
    assert args.port == gw["ports"][0]["containerPort"]


def test_probes_use_the_real_health_endpoints(manifests: list[dict[str, Any]]) -> None:
    gateway = find(manifests, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/api/v1/healthz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    sched = find(manifests, "StatefulSet", "scheduler")["spec"]["template"]["spec"]
    container = sched["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    for workload in pod_specs(manifests):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                http = c.get(probe, {}).get("httpGet")
                if http:
                    assert http["port"] in names, (c["name"], probe)


def test_services_select_pods_and_name_their_ports(manifests: list[dict[str, Any]]) -> None:
    workloads = list(pod_specs(manifests))
    for svc in (d for d in manifests if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [
            w["spec"]["template"]
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, svc["metadata"]["name"]
        ports = {p["name"] for c in pods[0]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)


def test_secrets_and_volumes_resolve(manifests: list[dict[str, Any]]) -> None:
    secrets = {d["metadata"]["name"]: d for d in manifests if d["kind"] == "Secret"}
    maps = {d["metadata"]["name"] for d in manifests if d["kind"] == "ConfigMap"}
    claims = {d["metadata"]["name"] for d in manifests if d["kind"] == "PersistentVolumeClaim"}
    external = {"lockstep-redis"} if "lockstep-redis" not in secrets else set()  # gpu values
    text = json.dumps(manifests)
    assert "existingClaim" not in text
    for workload in pod_specs(manifests):
        spec = workload["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                secret = secrets[volume["secret"]["secretName"]]
                for item in volume["secret"].get("items", []):
                    assert item["key"] in secret["data"], (volume, secret["data"].keys())
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps
            if "persistentVolumeClaim" in volume and volume["name"] == "data":
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] not in external:
                    assert ref["key"] in secrets[ref["name"]]["data"], env


def test_prometheus_rule_carries_the_alert_file() -> None:
    docs = render(VALUE_SETS["gpu"])
    rule = find(docs, "PrometheusRule", "monitoring")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    monitor = find(docs, "ServiceMonitor", "monitoring")
    ports = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


def _merged(values: dict[str, Any]) -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        merged: dict[str, Any] = chart.merge_values(copy.deepcopy(values))
    return merged


def test_values_schema_accepts_the_shipped_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(defaults, schema)
    for values in VALUE_SETS.values():
        jsonschema.validate(_merged(values), schema)


@pytest.mark.parametrize(
    "bad",
    [
        {"scheduler": {"clock": {"policy": "sometimes"}}},
        {"workers": {"gpus": -1}},
        {"shceduler": {}},
        {"gateway": {"longPollSeconds": 60}},
        {"redis": {"enabled": False}},
        {"sglang": {"enabled": True}},
        {"sglang": {"enabled": True, "modelPath": "/models/m"}},  # no pinned image tag
        {"persistence": {"accessModes": ["ReadMostly"]}},
        {"scheduler": {"limits": {"maxTenants": -1}}},
        {"scheduler": {"limits": {"maxTenantz": 3}}},
        {"scheduler": {"sampler": {"kind": "triton"}}},
        {"workers": {"engine": {"tp": 0}}},
    ],
)
def test_values_schema_refuses_bad_values(bad: dict[str, Any]) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    merged = _deep_merge(defaults, bad)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged, schema)
    with pytest.raises(helm.HelmError):
        render(bad)  # Helm itself checks values.schema.json before rendering


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def test_generated_secrets_and_shell_quoting() -> None:
    docs = render({})
    secret = next(d for d in docs if d["metadata"]["name"] == "lockstep-api-keys")
    import base64

    key = base64.b64decode(secret["data"]["api-keys"]).decode()
    assert key.startswith("tml-") and len(key) == 52
    redis = find(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    assert shlex.split(redis["command"][2])[:2] == ["exec", "valkey-server"]


SERVE_VALUES: dict[str, Any] = {
    "scheduler": {
        "limits": {
            "maxTokensPerDatum": 0,
            "maxDatumsPerRequest": 64,
            "maxTenants": 40,
            "maxTenantsPerKey": 3,
            "maxTokensPerCyclePerKey": 8192,
            "futureTtlSeconds": 86400,
            "maxPendingPerModel": 100,
            "maxPendingSamples": 500,
            "maxSamplesPerRequest": 16,
            "maxLoraRank": 32,
        },
        "sampler": {
            "kind": "sglang",
            "url": "http://lockstep-sglang:30000",
            "maxAdapters": 6,
            "colocate": True,
        },
    },
    "workers": {
        "engine": {
            "kind": "megatron",
            "tp": 2,
            "pp": 2,
            "dp": 3,
            "cp": 1,
            "ep": 3,
            "rayAddress": "ray://ray-head:10001",
            "rayPlacement": "STRICT_SPREAD",
            "rayAuthTokenSecret": {"name": "raycluster-token", "key": "auth_token"},
        }
    },
}


def _scheduler_config(docs: list[dict[str, Any]]) -> Any:
    container = find(docs, "StatefulSet", "scheduler")["spec"]["template"]["spec"]["containers"][0]
    return scheduler_args(
        [a.replace("$(LOCKSTEP_REDIS_URL)", "redis://r:6379/0") for a in container["args"]]
    ), container["args"]


def test_limit_sampler_and_engine_values_render_to_their_flags() -> None:
    """Every value set reaches the real scheduler CLI as its flag; the gateway gets the datum
    limit too (it tells the SDK to chunk below it)."""
    docs = render(SERVE_VALUES)
    cfg, _ = _scheduler_config(docs)
    lim = cfg.limits
    assert (
        lim.max_tokens_per_datum,
        lim.max_datums_per_request,
        lim.max_tenants,
        lim.max_tenants_per_key,
        lim.max_tokens_per_cycle_per_key,
        lim.future_ttl_s,
        lim.max_pending_per_model,
        lim.max_pending_samples,
        lim.max_samples_per_request,
    ) == (0, 64, 40, 3, 8192, 86400, 100, 500, 16)
    s = cfg.sampler
    assert (s.kind, s.url, s.max_adapters, s.colocate, s.max_lora_rank) == (
        "sglang",
        "http://lockstep-sglang:30000",
        6,
        True,
        32,
    )
    e = cfg.engine
    assert (
        e.kind,
        e.parallel.tp,
        e.parallel.pp,
        e.parallel.dp,
        e.parallel.cp,
        e.parallel.ep,
        e.ray_address,
        e.ray_placement,
    ) == ("megatron", 2, 2, 3, 1, 3, "ray://ray-head:10001", "STRICT_SPREAD")
    container = find(docs, "StatefulSet", "scheduler")["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v for v in container["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "raycluster-token",
        "key": "auth_token",
    }
    gw = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway_parser().parse_args(gw["args"]).max_datums_per_request == 64
    for doc in pod_specs(docs):  # still valid workloads
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)


def test_unset_values_render_no_flag() -> None:
    """null (the default) renders nothing: the CLI's own defaults apply."""
    docs = render({})
    cfg, args = _scheduler_config(docs)
    flags = {a.split("=")[0] for a in args}
    assert not flags & {
        "--max-tenants",
        "--max-tokens-per-cycle-per-key",
        "--future-ttl",
        "--sampler",
        "--sampler-url",
        "--max-adapters",
        "--colocate",
        "--engine",
        "--tp",
        "--pp",
        "--dp",
        "--cp",
        "--ep",
        "--ray-address",
        "--ray-placement",
        "--max-lora-rank",
        "--max-datums-per-request",
    }
    assert cfg.limits == type(cfg.limits)() and cfg.sampler == type(cfg.sampler)()
    container = find(docs, "StatefulSet", "scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert not any(v["name"].startswith("RAY_") for v in container["env"])
    gw = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--max-datums-per-request") for a in gw["args"])
    # one set value among nulls renders alone (0 counts as set: it means "no limit")
    _, args = _scheduler_config(render({"scheduler": {"limits": {"maxTenants": 0}}}))
    assert [a for a in args if a.startswith("--max-")] == ["--max-tenants=0"]
