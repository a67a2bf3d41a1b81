"""Prometheus integration files (prometheus.yml, file_sd targets) and the helper that writes the targets file."""
