"""The Helm chart takes the API key and the cluster token from a Kubernetes Secret: every worker
container and the proxy read them from `auth.secretName`; the chart creates the Secret only when asked."""

from __future__ import annotations

from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "hybridpd"


def secret_env(env: list[dict], name: str) -> dict:
    entry = next(e for e in env if e["name"] == name)
    return entry["valueFrom"]["secretKeyRef"]


def test_workers_read_the_cluster_token_from_the_secret() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["auth"] == {"secretName": "hybridpd-auth", "create": False, "apiKey": "", "clusterToken": ""}
    groups = values["rayCluster"]["spec"]["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"prefill", "decode"}
    for g in groups:
        for c in g["template"]["spec"]["containers"]:
            ref = secret_env(c["env"], "HYBRIDPD_CLUSTER_TOKEN")
            assert ref == {"name": "{{ .Values.auth.secretName }}", "key": "cluster-token", "optional": True}


def test_proxy_reads_both_and_the_secret_template_is_opt_in() -> None:
    proxy = (CHART / "templates" / "proxy-deployment.yaml").read_text()
    for var, key in (("HYBRIDPD_API_KEY", "api-key"), ("HYBRIDPD_CLUSTER_TOKEN", "cluster-token")):
        block = proxy[proxy.index(f"name: {var}"):]
        assert f"key: {key}" in block[:300] and ".Values.auth.secretName" in block[:300]
    secret = (CHART / "templates" / "auth-secret.yaml").read_text()
    assert "{{- if .Values.auth.create }}" in secret and "cluster-token:" in secret and "api-key:" in secret
