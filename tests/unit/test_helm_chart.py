"""Checks of the Helm chart deploy/helm/hybridpd that need neither helm nor a Kubernetes cluster.

The chart is built so that its main object can be checked without helm: templates/raycluster.yaml only wraps
`rayCluster.spec` from values.yaml (metadata from the chart, spec through `tpl`, whose only use is resolving
`{{ .Values.<path> }}` in strings). `render_raycluster()` re-implements that wrapper, and the result is validated
against KubeRay's RayCluster CRD schema (ray.io/v1 openAPIV3Schema) with jsonschema, plus a strict unknown-field
check like kubectl's default `--validate=strict` (the CRD schema itself does not forbid extra fields: the API server
would prune them silently).

What jsonschema cannot see: the CRD's `x-kubernetes-*` keys (CEL `x-kubernetes-validations`, list-map keys) are
ignored, and KubeRay's own webhook/controller validation is not run. If `helm` is on PATH, `helm lint` and
`helm template` run too and the rendered RayCluster must equal the re-implementation's.

Schema: $HYBRIDPD_KUBERAY_SCHEMA, else the in-repo copy tests/data/kuberay/ray.io_rayclusters.yaml, else
../shared/schemas/kuberay/ray.io_rayclusters.yaml next to the repository.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "hybridpd"
SCHEMA_IN_REPO = REPO / "tests" / "data" / "kuberay" / "ray.io_rayclusters.yaml"
SCHEMA_SHARED = REPO.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayclusters.yaml"
RELEASE = "hybridpd"
NAMESPACE = "default"
ROLES = ("prefill", "decode")

_VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_TPL_REF = re.compile(r"\{\{\s*\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)\s*\}\}")


# ---------------------------------------------------------------------------------------------------------------
# loading and rendering
# ---------------------------------------------------------------------------------------------------------------


def load_chart() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def load_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def schema_path() -> Path:
    env = os.environ.get("HYBRIDPD_KUBERAY_SCHEMA")
    if env:
        return Path(env)
    return SCHEMA_IN_REPO if SCHEMA_IN_REPO.exists() else SCHEMA_SHARED


@cache
def raycluster_schema() -> dict[str, Any]:
    path = schema_path()
    if not path.exists():
        pytest.skip(f"KubeRay CRD schema not found at {path}")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is ~1 MB: libyaml parses it 10x faster
    crd = yaml.load(path.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def _int_format(bits: int) -> Any:
    def check(value: object) -> bool:
        return not isinstance(value, int) or -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)

    return check


_FORMATS = jsonschema.FormatChecker()
_FORMATS.checks("int32")(_int_format(32))
_FORMATS.checks("int64")(_int_format(64))


@cache
def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(raycluster_schema(), format_checker=_FORMATS)


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """jsonschema errors of a RayCluster object against the CRD's openAPIV3Schema (Draft 7 semantics)."""
    validator = _validator()
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the structural schema does not declare (kubectl --validate=strict rejects them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], f"{path}/{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}/{key}")
            elif props is not None:
                found.append(f"{path}/{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}/{i}")
    return found


def fullname(values: dict[str, Any], release: str = RELEASE) -> str:
    """templates/_helpers.tpl "hybridpd.fullname"."""
    if values.get("fullnameOverride"):
        return values["fullnameOverride"][:50].rstrip("-")
    name = values.get("nameOverride") or load_chart()["name"]
    return (release if name in release else f"{release}-{name}")[:50].rstrip("-")


def chart_labels(release: str = RELEASE) -> dict[str, str]:
    """templates/_helpers.tpl "hybridpd.labels"."""
    chart = load_chart()
    return {
        "helm.sh/chart": f"{chart['name']}-{chart['version']}".replace("+", "_"),
        "app.kubernetes.io/name": chart["name"],
        "app.kubernetes.io/instance": release,
        "app.kubernetes.io/version": str(chart["appVersion"]),
        "app.kubernetes.io/managed-by": "Helm",
    }


def lookup(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for key in dotted.strip(".").split("."):
        if not isinstance(node, dict) or key not in node:
            raise KeyError(f".Values{dotted}")
        node = node[key]
    return node


def go_text(value: str | int | float) -> str:
    """How Go's text/template prints a value: a float64 in its shortest form, without ".0" when whole. Floats Go
    prints with an exponent (below 1e-4 or from 1e6 on) are refused, not imitated."""
    if isinstance(value, float):
        assert value == 0 or 1e-4 <= abs(value) < 1e6, f"{value!r}: Go would print it with an exponent"
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def resolve_tpl(node: Any, values: dict[str, Any]) -> Any:
    """What `tpl (toYaml spec) .` does to rayCluster.spec: `{{ .Values.x }}` in strings becomes the value's text.
    Any other template construct is refused, so that this stays an exact re-implementation."""
    if isinstance(node, dict):
        return {k: resolve_tpl(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_tpl(v, values) for v in node]
    if isinstance(node, str) and "{{" in node:

        def sub(m: re.Match[str]) -> str:
            value = lookup(values, m.group(1))
            assert isinstance(value, (str, int, float)) and not isinstance(value, bool), f"{m.group(0)} not a scalar"
            text = go_text(value)
            assert not re.search(r"[\"'\n{}]", text), f"{m.group(0)} = {text!r} would change the YAML around it"
            return text

        out = _TPL_REF.sub(sub, node)
        assert "{{" not in out, f"only {{{{ .Values.<path> }}}} is supported in rayCluster.spec: {node!r}"
        return out
    return node


def render_raycluster(values: dict[str, Any], release: str = RELEASE) -> dict[str, Any]:
    """templates/raycluster.yaml, in Python."""
    cluster = values["rayCluster"]
    metadata: dict[str, Any] = {"name": fullname(values, release), "labels": chart_labels(release)}
    metadata["labels"].update(cluster.get("labels") or {})
    if cluster.get("annotations"):
        metadata["annotations"] = dict(cluster["annotations"])
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": metadata,
            "spec": resolve_tpl(copy.deepcopy(cluster["spec"]), values)}


def default_raycluster() -> dict[str, Any]:
    return render_raycluster(load_values())


def worker_group(cluster: dict[str, Any], role: str) -> dict[str, Any]:
    (group,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == role]
    return group


# ---------------------------------------------------------------------------------------------------------------
# chart files
# ---------------------------------------------------------------------------------------------------------------


def test_chart_yaml() -> None:
    chart = load_chart()
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "hybridpd" == CHART.name
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert chart["appVersion"]


def test_values_parse_and_are_documented() -> None:
    values = load_values()
    text = (CHART / "values.yaml").read_text().splitlines()
    for key in values:
        i = next(n for n, line in enumerate(text) if line.startswith(f"{key}:"))
        assert text[i - 1].startswith("#"), f"values.yaml: top-level key {key!r} has no comment above it"


def test_every_values_path_used_exists() -> None:
    values = load_values()
    sources = {p.name: p.read_text() for p in (CHART / "templates").iterdir() if p.is_file()}
    sources["values.yaml (tpl)"] = yaml.safe_dump(values["rayCluster"]["spec"])
    used = {(name, m.group(1)) for name, text in sources.items() for m in _VALUES_REF.finditer(text)}
    assert used, "no .Values reference found: the regex is broken"
    missing = []
    for name, dotted in sorted(used):
        try:
            lookup(values, dotted)
        except KeyError:
            missing.append(f"{name}: .Values{dotted}")
    assert not missing, missing


def test_raycluster_template_only_wraps_values() -> None:
    """render_raycluster() is only valid while the template stays this thin."""
    text = (CHART / "templates" / "raycluster.yaml").read_text()
    body = re.sub(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", "", text, flags=re.S)
    assert "apiVersion: ray.io/v1\nkind: RayCluster\n" in body
    assert "{{- tpl (toYaml .Values.rayCluster.spec) . | nindent 2 }}" in body
    assert set(_VALUES_REF.findall(body)) == {".rayCluster.labels", ".rayCluster.annotations", ".rayCluster.spec"}


# ---------------------------------------------------------------------------------------------------------------
# the RayCluster against KubeRay's CRD
# ---------------------------------------------------------------------------------------------------------------


def test_schema_is_the_raycluster_crd() -> None:
    schema = raycluster_schema()
    assert schema["properties"]["spec"]["required"] == ["headGroupSpec"]
    worker = schema["properties"]["spec"]["properties"]["workerGroupSpecs"]["items"]
    assert "groupName" in worker["required"]


def test_schema_copy_matches_shared() -> None:
    if not SCHEMA_SHARED.exists():
        pytest.skip(f"no shared copy at {SCHEMA_SHARED} to compare with")
    assert SCHEMA_IN_REPO.read_bytes() == SCHEMA_SHARED.read_bytes(), "refresh tests/data/kuberay from shared/"


def test_default_raycluster_validates() -> None:
    cluster = default_raycluster()
    assert schema_errors(cluster) == []
    assert unknown_fields(cluster, raycluster_schema()) == []


def test_metadata_name_is_a_dns_label() -> None:
    """KubeRay requires a DNS-1035 label of at most 63 characters; suffixes it adds need room (hence 50)."""
    name = default_raycluster()["metadata"]["name"]
    assert name == RELEASE
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 50
    long_release = "a" * 70
    assert len(render_raycluster(load_values(), release=long_release)["metadata"]["name"]) == 50


def _drop_group_name(c: dict[str, Any]) -> None:
    del c["spec"]["workerGroupSpecs"][0]["groupName"]


def _replicas_as_word(c: dict[str, Any]) -> None:
    c["spec"]["workerGroupSpecs"][1]["replicas"] = "two"


def _replicas_overflow(c: dict[str, Any]) -> None:
    c["spec"]["workerGroupSpecs"][1]["replicas"] = 2**31


def _no_head_template(c: dict[str, Any]) -> None:
    del c["spec"]["headGroupSpec"]["template"]


def _no_head(c: dict[str, Any]) -> None:
    del c["spec"]["headGroupSpec"]


def _start_param_not_string(c: dict[str, Any]) -> None:
    c["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0


def _container_port_name(c: dict[str, Any]) -> None:
    c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"


def _container_without_name(c: dict[str, Any]) -> None:
    del c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["name"]


def _bad_gpu_quantity(c: dict[str, Any]) -> None:
    res = c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    res["limits"]["nvidia.com/gpu"] = "one"


@pytest.mark.parametrize(
    "break_it",
    [_drop_group_name, _replicas_as_word, _replicas_overflow, _no_head_template, _no_head, _start_param_not_string,
     _container_port_name, _container_without_name, _bad_gpu_quantity],
)
def test_broken_raycluster_does_not_validate(break_it: Any) -> None:
    cluster = default_raycluster()
    break_it(cluster)
    assert schema_errors(cluster), f"{break_it.__name__} still validates"


def test_unknown_field_is_caught() -> None:
    cluster = default_raycluster()
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2  # typo of replicas
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["commands"] = ["x"]
    assert unknown_fields(cluster, raycluster_schema()) == [
        "/spec/headGroupSpec/template/spec/containers/0/commands",
        "/spec/workerGroupSpecs/0/replica",
    ]


# ---------------------------------------------------------------------------------------------------------------
# what the pods run
# ---------------------------------------------------------------------------------------------------------------


def test_kuberay_runs_our_commands() -> None:
    """Without the annotation KubeRay would wrap the containers' commands in its own `ray start`."""
    cluster = default_raycluster()
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(head["args"])
    assert "hybridpd" not in " ".join(head["args"])


@pytest.mark.parametrize("role", ROLES)
def test_worker_group_runs_one_hybridpd_worker(role: str) -> None:
    values = load_values()
    cluster = render_raycluster(values)
    group = worker_group(cluster, role)
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    script = " ".join(container["command"] + container["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in script, "the pod must join the Ray cluster"
    ports = values["ports"]
    worker_cmd = (f"exec hybridpd worker --role {role} --model {values['model']['path']} --host 0.0.0.0 "
                  f"--port {ports['workerGrpc']} --metrics-port {ports['workerMetrics']}")
    assert worker_cmd in script
    # live membership: the worker registers with every proxy pod (headless Service) under its pod IP
    members = f"http://{values['proxy']['membersService']}:{ports['proxy']}"
    assert f'--advertise-host "$POD_IP" --register-with {members}' in script
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["image"] == values["image"]
    # one GPU per worker pod, requested and limited
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    # container ports equal the values the Services and the command use (numbers cannot be templated)
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert by_name == {"hpd-grpc": ports["workerGrpc"], "hpd-metrics": ports["workerMetrics"]}
    assert ports["workerMetrics"] != 8080, "KubeRay gives 8080 to Ray's own metrics export"
    # the model volume is mounted where --model points
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert values["model"]["path"].startswith(mounts["model"]["mountPath"].rstrip("/") + "/")
    assert "persistentVolumeClaim" in volumes["model"]
    # the worker Service selects these pods by this label
    assert group["template"]["metadata"]["labels"]["hybridpd.io/role"] == role


def _worker_args(cluster: dict[str, Any], role: str) -> argparse.Namespace:
    """The `hybridpd worker` command a worker pod of `role` runs, parsed by the CLI's own parser."""
    from hybridpd.deploy.cli import build_parser

    script = worker_group(cluster, role)["template"]["spec"]["containers"][0]["args"][0]
    (line,) = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("exec hybridpd worker ")]
    return build_parser().parse_args(shlex.split(line.replace('"$POD_IP"', "10.0.0.1"))[2:])


def test_prefill_max_decode_share_reaches_prefill_workers_only() -> None:
    values = load_values()
    default = render_raycluster(values)
    assert values["prefill"]["maxDecodeShare"] == 0.25
    assert _worker_args(default, "prefill").max_decode_share == 0.25
    values["prefill"]["maxDecodeShare"] = 0.1
    cluster = render_raycluster(values)
    assert schema_errors(cluster) == []
    prefill, decode = _worker_args(cluster, "prefill"), _worker_args(cluster, "decode")
    assert (prefill.role, prefill.max_decode_share) == ("prefill", 0.1)
    assert "--max-decode-share" not in worker_group(cluster, "decode")["template"]["spec"]["containers"][0]["args"][0]
    assert decode.role == "decode"


# ---------------------------------------------------------------------------------------------------------------
# helm itself, where installed
# ---------------------------------------------------------------------------------------------------------------


def _helm(*args: str) -> str:
    helm = shutil.which("helm")
    if helm is None:
        pytest.skip("helm is not on PATH: `helm lint` / `helm template` not run (the checks above cover values.yaml)")
    out = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_helm_lint() -> None:
    _helm("lint", str(CHART), "--strict")


@pytest.mark.parametrize("service_monitor", [False, True])
def test_helm_template_matches_and_validates(service_monitor: bool) -> None:
    out = _helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                "--set", f"serviceMonitor.enabled={str(service_monitor).lower()}")
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = sorted(d["kind"] for d in docs)
    expected = ["Deployment", "RayCluster", "Service", "Service", "Service", "Service"]
    assert kinds == sorted(expected + (["ServiceMonitor"] if service_monitor else []))
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    assert cluster == default_raycluster(), "render_raycluster() no longer matches templates/raycluster.yaml"
    assert schema_errors(cluster) == []
    name = fullname(load_values())
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    members = load_values()["proxy"]["membersService"]
    assert set(services) == {f"{name}-proxy", f"{name}-prefill", f"{name}-decode", members}
    assert services[members]["spec"]["clusterIP"] == "None"  # every proxy pod's address: workers register with each
    assert services[members]["spec"]["selector"] == services[f"{name}-proxy"]["spec"]["selector"]
    for role in ROLES:
        svc = services[f"{name}-{role}"]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "hybridpd.io/role": role}
        assert svc["metadata"]["labels"]["hybridpd.io/job"] == f"hybridpd-{role}"
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    # no static worker list (one address per headless Service name would pin one pod per role): workers register;
    # the proxy loads the tokenizer from the model volume
    assert "--prefill" not in args and "--decode" not in args
    assert args[args.index("--model") + 1] == load_values()["model"]["path"]
    assert args[args.index("--routing") + 1] == "cache_aware"


def test_helm_template_with_overrides() -> None:
    """`--set image=...` and `--set model.path=...` reach every Ray container through tpl."""
    out = _helm("template", "r1", str(CHART), "--set", "image=registry.example/hybridpd:9", "--set",
                "model.path=/models/other", "--set", "prefill.maxDecodeShare=0.5")
    (cluster,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "RayCluster"]
    values = load_values()
    values["image"] = "registry.example/hybridpd:9"
    values["model"]["path"] = "/models/other"
    values["prefill"]["maxDecodeShare"] = 0.5
    assert cluster == render_raycluster(values, release="r1")
    assert _worker_args(cluster, "prefill").max_decode_share == 0.5
    assert "--model /models/other" in worker_group(cluster, "decode")["template"]["spec"]["containers"][0]["args"][0]


def test_workers_run_on_their_gpu_and_take_engine_args() -> None:
    """By default a worker pod's engine runs on its GPU (`--device auto --dtype auto`, the CLI's defaults) with the
    fast path required; `workers.engineArgs` reaches both roles' engines."""
    values = load_values()
    for role in ROLES:
        args = _worker_args(render_raycluster(values), role)
        assert (args.device, args.dtype, args.allow_reference_path) == ("auto", "auto", False)
    values["workers"]["engineArgs"] = "--max-model-len 8192 --gpu-memory-utilization 0.85 --dtype float16"
    cluster = render_raycluster(values)
    assert schema_errors(cluster) == []
    for role in ROLES:
        args = _worker_args(cluster, role)
        assert (args.role, args.max_model_len, args.gpu_memory_utilization, args.dtype) == (role, 8192, 0.85, "float16")
