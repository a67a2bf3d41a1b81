"""KV-cache and recurrent-state transfer between prefill (P) and decode (D) workers over NIXL.

Public API (see each module's docstring for ownership and threads):

    layout:   Region, GroupTensors, CacheLayout(.from_tensors), PROTOCOL_VERSION
    agent:    AgentConfig, TransferAgent(name, layout, epoch=None, *, config=None, metrics=None), PeerHandle
    pull:     PullSpec, start_pull(peer, spec, *, timeout_s, policy) -> PullHandle, PullState, PullResult,
              TransferPolicy
    lease:    LeaseTable(epoch, ttl_s=30, *, clock, metrics), Lease
    notify:   ReleaseNotice
    metrics:  TransferMetrics(role, registry=None)
    errors:   TransferError, MetadataError, ProtocolMismatchError, CompatibilityError, StaleEpochError,
              UnknownPeerError
"""

from __future__ import annotations

from .agent import AgentConfig, PeerHandle, TransferAgent
from .errors import (
    CompatibilityError,
    MetadataError,
    ProtocolMismatchError,
    StaleEpochError,
    TransferError,
    UnknownPeerError,
)
from .layout import PROTOCOL_VERSION, CacheLayout, GroupTensors, Region
from .lease import Lease, LeaseTable
from .metrics import TransferMetrics
from .notify import ReleaseNotice
from .pull import PullHandle, PullResult, PullSpec, PullState, TransferPolicy, start_pull

__all__ = [
    "PROTOCOL_VERSION",
    "AgentConfig",
    "CacheLayout",
    "CompatibilityError",
    "GroupTensors",
    "Lease",
    "LeaseTable",
    "MetadataError",
    "PeerHandle",
    "ProtocolMismatchError",
    "PullHandle",
    "PullResult",
    "PullSpec",
    "PullState",
    "Region",
    "ReleaseNotice",
    "StaleEpochError",
    "TransferAgent",
    "TransferError",
    "TransferMetrics",
    "TransferPolicy",
    "UnknownPeerError",
    "start_pull",
]
