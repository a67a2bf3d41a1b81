"""Static checks of the observability files: the Grafana dashboard, its provisioning, the Prometheus scrape config.

What is checked without any server:

- the dashboard is valid Grafana JSON (schemaVersion >= 36, datasource through the DS_PROMETHEUS variable, unique
  ids, no overlapping panels), every panel has PromQL, every metric it names is in the metric contract (or is
  Prometheus' own `up`), every label it groups by exists on those metrics, and every contract metric is shown;
- with `promtool` (scripts/install-prometheus.sh installs it; skipped with that reason otherwise): every expression
  parses (`promtool check rules`), every expression returns data on synthetic series shaped like the contract
  (`promtool test rules`, Prometheus' own engine, no server), and prometheus.yml passes `promtool check config`.

Helpers for the live-server test (which evaluates the same expressions against a Prometheus scraping a running
cluster): `dashboard_expressions()`, `for_prometheus()`, `metric_names()`, `DESIGN_METRICS`. Import this module by
path (tests/ is not a package), e.g. with importlib.util.spec_from_file_location.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hybridpd.deploy.prometheus.targets import targets_from_cluster, write_targets

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "hybridpd.json"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"

# The metric contract: name -> (type, labels the process itself exports).
DESIGN_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "hybridpd_prefix_cache_queries_total": ("counter", frozenset({"role", "group"})),
    "hybridpd_prefix_cache_hits_total": ("counter", frozenset({"role", "group"})),
    "hybridpd_external_prefix_cache_queries_total": ("counter", frozenset({"role", "group"})),
    "hybridpd_external_prefix_cache_hits_total": ("counter", frozenset({"role", "group"})),
    "hybridpd_kv_cache_usage_ratio": ("gauge", frozenset({"role", "group"})),
    "hybridpd_kv_transfer_bytes_total": ("counter", frozenset({"role"})),
    "hybridpd_kv_transfer_seconds": ("histogram", frozenset({"role"})),
    "hybridpd_kv_transfer_descriptors": ("histogram", frozenset({"role"})),
    "hybridpd_kv_transfer_failures_total": ("counter", frozenset({"role", "reason"})),
    "hybridpd_kv_lease_expired_total": ("counter", frozenset({"role"})),
    "hybridpd_zeroed_blocks_total": ("counter", frozenset({"role"})),
    "hybridpd_num_requests_running": ("gauge", frozenset({"role"})),
    "hybridpd_num_requests_waiting": ("gauge", frozenset({"role"})),
    "hybridpd_time_to_first_token_seconds": ("histogram", frozenset()),
    "hybridpd_inter_token_latency_seconds": ("histogram", frozenset()),
    "hybridpd_e2e_request_latency_seconds": ("histogram", frozenset()),
    "hybridpd_requests_total": ("counter", frozenset({"status"})),
}
# Series Prometheus itself writes for every target.
PROMETHEUS_SERIES: dict[str, frozenset[str]] = {"up": frozenset()}
# Labels Prometheus attaches to every scraped series (deploy/prometheus/prometheus.yml adds `role` to targets).
TARGET_LABELS = frozenset({"job", "instance", "role"})
GROUP_VALUES = ("attention", "mamba2", "gated_deltanet")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# What Grafana substitutes before sending a query; stand-ins valid for a Prometheus query.
GRAFANA_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "instance": ".*",
}

_PROMQL_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
     "inf", "nan"}
)


# ---------------------------------------------------------------------------------------------------------------
# helpers (also used by the live-server test)
# ---------------------------------------------------------------------------------------------------------------


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows; rows themselves are yielded too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in iter_panels(dashboard) if p.get("type") != "row"]


def dashboard_expressions(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL expression of the dashboard, as written (with Grafana variables), in panel order."""
    return [t["expr"] for p in query_panels(load_dashboard(path)) for t in p.get("targets", []) if t.get("expr")]


def for_prometheus(expr: str) -> str:
    """The expression as Grafana would send it, with GRAFANA_VARIABLES substituted; unknown variables raise."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in GRAFANA_VARIABLES:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def _strip_promql(expr: str) -> str:
    """The expression with strings, label matchers, ranges, numbers and modifier label lists removed."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", "{}", s)
    s = re.sub(r"\[[^\]]*\]", "[]", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    return re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", s)


def metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (identifiers that are not functions, keywords or labels)."""
    s = _strip_promql(expr)
    names = set()
    for m in re.finditer(r"(?<![\w:])([A-Za-z_:][\w:]*)(\s*\()?", s):
        if not m.group(2) and m.group(1).lower() not in _PROMQL_KEYWORDS:
            names.add(m.group(1))
    return names


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by(...) / without(...) / on(...) / ignoring(...) / group_x(...) clauses."""
    labels: set[str] = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(x.strip() for x in m.group(1).split(",") if x.strip())
    return labels


def matcher_labels(expr: str) -> set[str]:
    return {m.group(1) for sel in re.findall(r"\{([^}]*)\}", expr) for m in re.finditer(r"(\w+)\s*[=!]~?", sel)}


def contract_metric(name: str) -> str | None:
    """The contract metric a series name belongs to (histogram series map to their base), else None."""
    if name in DESIGN_METRICS:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and DESIGN_METRICS.get(base, ("", None))[0] == "histogram":
            return base
    return None


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not on PATH: run scripts/install-prometheus.sh (Debian's prometheus package)")
    return path


# ---------------------------------------------------------------------------------------------------------------
# the helpers themselves (the checks below are only as good as these)
# ---------------------------------------------------------------------------------------------------------------


def test_metric_name_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, role) (rate(hybridpd_kv_transfer_seconds_bucket{role="decode",'
        'instance=~"$instance"}[$__rate_interval]))) / on(role) group_left() max by (role) (foo_total offset 5m) '
        "* 1e9 + bar"
    )
    assert metric_names(expr) == {"hybridpd_kv_transfer_seconds_bucket", "foo_total", "bar"}
    assert grouping_labels(expr) == {"le", "role"}
    assert matcher_labels(expr) == {"role", "instance"}
    assert contract_metric("hybridpd_kv_transfer_seconds_bucket") == "hybridpd_kv_transfer_seconds"
    assert contract_metric("hybridpd_requests_total_count") is None  # a counter has no _count series
    assert contract_metric("hybridpd_prefix_cache_hit_total") is None  # typo


def test_grafana_variable_substitution() -> None:
    assert for_prometheus('rate(x{instance=~"$instance"}[$__rate_interval])') == 'rate(x{instance=~".*"}[1m])'
    assert for_prometheus("increase(x[${__range}])") == "increase(x[1h])"
    with pytest.raises(KeyError):
        for_prometheus("rate(x[$__nope])")


# ---------------------------------------------------------------------------------------------------------------
# dashboard
# ---------------------------------------------------------------------------------------------------------------


def test_dashboard_is_grafana_json() -> None:
    dash = load_dashboard()
    assert dash["schemaVersion"] >= 36
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in iter_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in query_panels(dash):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in iter_panels(load_dashboard()):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_panel_has_promql() -> None:
    for panel in query_panels(load_dashboard()):
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r} target {target['refId']} has no expr"


def test_metrics_are_in_the_contract() -> None:
    for expr in dashboard_expressions():
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            assert contract_metric(name) or name in PROMETHEUS_SERIES, f"{name!r} is not a contract metric: {expr!r}"
            if DESIGN_METRICS.get(name, ("", None))[0] == "histogram":
                pytest.fail(f"histogram {name!r} has no series of that name; use _bucket/_sum/_count: {expr!r}")
        assert "__name__" not in expr, "select metrics by name so that this check sees them"


def test_labels_exist_on_the_metrics() -> None:
    for panel in query_panels(load_dashboard()):
        for target in panel["targets"]:
            expr = target["expr"]
            available = set(TARGET_LABELS)
            for name in metric_names(expr):
                base = contract_metric(name)
                available |= DESIGN_METRICS[base][1] if base else PROMETHEUS_SERIES.get(name, frozenset())
                if name.endswith("_bucket"):
                    available.add("le")
            used = grouping_labels(expr) | matcher_labels(expr)
            assert used <= available, f"{panel['title']!r}: labels {used - available} not on {metric_names(expr)}"
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert legend <= grouping_labels(expr), f"{panel['title']!r}: legend {legend} not kept by {expr!r}"


def test_every_contract_metric_is_on_the_dashboard() -> None:
    shown = {contract_metric(n) for e in dashboard_expressions() for n in metric_names(e)}
    assert set(DESIGN_METRICS) - shown == set()


def test_top_row_is_prefix_cache_hit_rate() -> None:
    """The first thing an operator sees: local and external hit rate, per role and cache group."""
    top = [p for p in query_panels(load_dashboard()) if p["gridPos"]["y"] <= 1]
    exprs = " ".join(t["expr"] for p in top for t in p["targets"])
    for metric in ("hybridpd_prefix_cache_hits_total", "hybridpd_external_prefix_cache_hits_total"):
        assert metric in exprs
    assert any(grouping_labels(t["expr"]) >= {"role", "group"} for p in top for t in p["targets"])


def test_expressions_parse_with_promtool(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = tmp_path / "dashboard.rules.yml"
    _write_recording_rules(rules)
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_expressions_return_data_on_contract_shaped_series(tmp_path: Path) -> None:
    """Evaluates every expression in promtool's PromQL engine over 10 minutes of synthetic series that carry the
    contract's names and labels. Each must return at least one non-NaN sample: catches wrong suffixes, joins that
    match nothing, `by` clauses that drop a label histogram_quantile needs."""
    promtool = _promtool()
    rules = tmp_path / "dashboard.rules.yml"
    names = _write_recording_rules(rules)
    tests = {
        "rule_files": [rules.name],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": _synthetic_series(),
            "promql_expr_test": [
                {"expr": f"absent({n} == {n})", "eval_time": "10m", "exp_samples": []} for n in names
            ],
        }],
    }
    test_file = tmp_path / "dashboard.test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    exprs = "\n".join(f"{n}: {e}" for n, e in zip(names, dashboard_expressions(), strict=True))
    assert out.returncode == 0, out.stdout + out.stderr + "\n" + exprs


def _write_recording_rules(path: Path) -> list[str]:
    exprs = dashboard_expressions()
    rules = [{"record": f"dashboard:expr_{i}", "expr": for_prometheus(e)} for i, e in enumerate(exprs)]
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    return [r["record"] for r in rules]


def _synthetic_series() -> list[dict[str, str]]:
    """10 minutes of every contract metric for 1 prefill + 1 decode worker and the proxy, as promtool input."""
    series: list[dict[str, str]] = []

    def add(name: str, labels: dict[str, str], values: str) -> None:
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        series.append({"series": f"{name}{{{body}}}", "values": values})

    proxy = {"job": "hybridpd-proxy", "instance": "127.0.0.1:8000", "role": "proxy"}
    workers = [{"job": f"hybridpd-{r}", "instance": f"127.0.0.1:800{i + 1}", "role": r}
               for i, r in enumerate(("prefill", "decode"))]
    for target in [proxy, *workers]:
        add("up", {k: v for k, v in target.items() if k != "role"} | {"role": target["role"]}, "1x40")
    for name, (kind, labels) in DESIGN_METRICS.items():
        if "role" in labels:
            label_sets = [w | {"group": g} for w in workers for g in GROUP_VALUES] if "group" in labels else workers
        else:
            label_sets = [proxy]
        if "reason" in labels:
            label_sets = [s | {"reason": "timeout"} for s in label_sets]
        if "status" in labels:
            label_sets = [s | {"status": st} for s in label_sets for st in ("success", "error")]
        for ls in label_sets:
            if kind == "counter":
                add(name, ls, "0+7x40")
            elif kind == "gauge":
                add(name, ls, "0.25+0x40")
            else:
                for i, le in enumerate(("0.01", "0.1", "1", "10", "+Inf")):
                    add(f"{name}_bucket", ls | {"le": le}, f"0+{i + 1}x40")
                add(f"{name}_sum", ls, "0+2x40")
                add(f"{name}_count", ls, "0+5x40")
    return series


# ---------------------------------------------------------------------------------------------------------------
# Grafana provisioning
# ---------------------------------------------------------------------------------------------------------------


def test_grafana_provisioning() -> None:
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"].startswith("http://")
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "hybridpd.yml").read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


# ---------------------------------------------------------------------------------------------------------------
# Prometheus scrape config
# ---------------------------------------------------------------------------------------------------------------


def _interval_seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert m, text
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def test_prometheus_config_jobs() -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert 1 <= _interval_seconds(config["global"]["scrape_interval"]) <= 5
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"hybridpd-proxy", "hybridpd-prefill", "hybridpd-decode"}
    for name, job in jobs.items():
        role = name.removeprefix("hybridpd-")
        for static in job.get("static_configs", []):
            assert static["labels"]["role"] == role
        (file_sd,) = job["file_sd_configs"]
        assert file_sd["files"] == ["targets/*.json"]
        keep = [r for r in job["relabel_configs"] if r["action"] == "keep"]
        assert keep == [{"source_labels": ["role"], "regex": role, "action": "keep"}]
        # workers (and the proxy's per-worker series) export `role` themselves; without honor_labels Prometheus
        # would rename it to exported_role
        assert job.get("honor_labels") is True


def test_targets_example_is_file_sd() -> None:
    groups = json.loads((PROMETHEUS_DIR / "targets.example.json").read_text())
    assert {g["labels"]["role"] for g in groups} == {"proxy", "prefill", "decode"}
    for group in groups:
        assert set(group) == {"targets", "labels"}
        for target in group["targets"]:
            assert re.fullmatch(r"[\w.-]+:\d+", target), target


def test_promtool_check_config(tmp_path: Path) -> None:
    promtool = _promtool()
    # a copy with the example as its only file_sd file, so that promtool also reads a real target file
    shutil.copy(PROMETHEUS_DIR / "prometheus.yml", tmp_path / "prometheus.yml")
    (tmp_path / "targets").mkdir()
    shutil.copy(PROMETHEUS_DIR / "targets.example.json", tmp_path / "targets" / "example.json")
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_targets_from_cluster(tmp_path: Path) -> None:
    """`GET /v1/cluster` (proxy/cluster_view.py) -> file_sd groups, one per role; unreachable workers left out."""
    cluster = {"workers": [
        {"role": "prefill", "address": "10.0.0.5:50051", "metrics_url": "http://10.0.0.5:8001/metrics"},
        {"role": "prefill", "address": "10.0.0.6:50051", "metrics_url": "http://10.0.0.6:8001/metrics"},
        {"role": "decode", "address": "[::1]:50052", "metrics_url": "http://[::1]:8002/metrics"},
        {"role": "decode", "address": "10.0.0.9:50052", "reachable": False, "error": "UNAVAILABLE: down"},
    ]}
    groups = targets_from_cluster(cluster, "127.0.0.1:8000")
    assert groups == [
        {"targets": ["127.0.0.1:8000"], "labels": {"role": "proxy"}},
        {"targets": ["10.0.0.5:8001", "10.0.0.6:8001"], "labels": {"role": "prefill"}},
        {"targets": ["[::1]:8002"], "labels": {"role": "decode"}},
    ]
    path = write_targets(groups, tmp_path / "targets" / "local.json")
    assert json.loads(path.read_text()) == groups
    assert [p.name for p in path.parent.iterdir()] == ["local.json"], "temporary file left behind"
