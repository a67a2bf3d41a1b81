"""Launchers and deployment files: the `hybridpd` CLI, the Ray launcher, Helm chart, Prometheus/Grafana config."""
