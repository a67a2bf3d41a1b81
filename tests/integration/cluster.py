"""Re-export of deploy.local_cluster for the integration tests."""

from __future__ import annotations

from hybridpd.deploy.local_cluster import Cluster, complete, start_cluster

__all__ = ["Cluster", "complete", "start_cluster"]
