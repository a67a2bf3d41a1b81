"""Two-process harness for tests and benchmarks (workers do not use it): synthetic hybrid caches and a producer
(P) process that owns them, publishes its metadata over a pipe and reports the release notices it receives.

    parent (D)                                  child: serve_producer (P)
    ctx.Process(target=serve_producer, ...)  -> builds caches (seeded random), TransferAgent
    conn.recv() == ("metadata", blob)        <- conn.send(("metadata", blob))
    start_pull(...) ... DONE                    (NIXL serves the READ; its progress thread runs)
    conn.send(("releases", 2.0))             -> drains poll_releases() until one arrives or 2 s pass
    conn.recv() == ("releases", [...])       <-
    conn.send(("tensors",))                  -> shares its cache tensors (CUDA IPC handles; benchmarks' raw copy)
    conn.recv() == ("tensors", groups)       <-
    conn.send(("stop",))                     -> closes the agent, exits
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from hybridpd.kvtransfer.agent import AgentConfig, TransferAgent
from hybridpd.kvtransfer.layout import GroupTensors

if TYPE_CHECKING:
    import torch

ATTN_GROUP, STATE_GROUP = 0, 1


@dataclass(frozen=True)
class ToyCacheSpec:
    """Shapes of a synthetic hybrid cache: group 0 = attention layers, group 1 = "mamba2" state layers."""

    model_id: str = "toy"
    attn_layers: int = 2
    num_blocks: int = 64
    block_size: int = 16
    kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"
    state_layers: int = 1
    num_slots: int = 8
    conv_shape: tuple[int, ...] = (3, 16)
    ssm_shape: tuple[int, ...] = (2, 8, 8)
    state_dtype: str = "float32"
    device: str = "cpu"
    stacked: bool = False  # one tensor per cache kind with the layer as dim 1 (what the engine allocates)

    @property
    def page_bytes(self) -> int:
        import torch

        elem = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.block_size * self.kv_heads * self.head_dim * elem


def _fill(shape: tuple[int, ...], dtype: str, seed: int | None, device: str) -> torch.Tensor:
    import torch

    dt = getattr(torch, dtype)
    if seed is None:
        return torch.zeros(shape, dtype=dt, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dt, device=device)


def make_caches(spec: ToyCacheSpec, seed: int | None) -> list[GroupTensors]:
    """Cache tensors of `spec`: random and reproducible from `seed` (a producer), or zeros (`seed=None`)."""
    s = (lambda i: None) if seed is None else (lambda i: seed * 1000 + i)  # noqa: E731
    if spec.stacked:
        return _make_stacked(spec, s)
    kv_shape = (spec.num_blocks, 2, spec.block_size, spec.kv_heads, spec.head_dim)
    attn = [_fill(kv_shape, spec.dtype, s(i), spec.device) for i in range(spec.attn_layers)]
    groups = [GroupTensors(ATTN_GROUP, "attention", attn)]
    if spec.state_layers:
        state = [
            (
                _fill((spec.num_slots, *spec.conv_shape), spec.state_dtype, s(100 + i), spec.device),
                _fill((spec.num_slots, *spec.ssm_shape), spec.state_dtype, s(200 + i), spec.device),
            )
            for i in range(spec.state_layers)
        ]
        groups.append(GroupTensors(STATE_GROUP, "mamba2", state, list(range(100, 100 + spec.state_layers))))
    return groups


def _make_stacked(spec: ToyCacheSpec, s: Any) -> list[GroupTensors]:
    kv_shape = (spec.num_blocks, spec.attn_layers, 2, spec.block_size, spec.kv_heads, spec.head_dim)
    groups = [GroupTensors(ATTN_GROUP, "attention", [_fill(kv_shape, spec.dtype, s(0), spec.device)], stacked=True)]
    if spec.state_layers:
        n = spec.state_layers
        conv = _fill((spec.num_slots, n, *spec.conv_shape), spec.state_dtype, s(100), spec.device)
        ssm = _fill((spec.num_slots, n, *spec.ssm_shape), spec.state_dtype, s(200), spec.device)
        groups.append(GroupTensors(STATE_GROUP, "mamba2", [(conv, ssm)], list(range(100, 100 + n)), stacked=True))
    return groups


def serve_producer(
    conn: Connection,
    spec: ToyCacheSpec,
    name: str,
    seed: int,
    config: AgentConfig | None = None,
    epoch: str | None = None,
) -> None:
    """Child-process entry of a producer (P). Runs until told to stop or the pipe closes."""
    from hybridpd.kvtransfer.layout import CacheLayout

    groups = make_caches(spec, seed)
    agent = TransferAgent(name, CacheLayout.from_tensors(groups, model_id=spec.model_id), epoch, config=config)
    conn.send(("metadata", agent.local_metadata()))
    pending: list[Any] = []
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "releases":
                deadline = time.monotonic() + float(msg[1])
                while not pending and time.monotonic() < deadline:
                    pending.extend(agent.poll_releases())
                    time.sleep(0.001)
                conn.send(("releases", [tuple(n) for n in pending]))
                pending = []
            if msg[0] == "tensors":
                import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reducers with the pipe's pickler

                conn.send(("tensors", [(g.group_id, g.tensors) for g in groups]))
    except EOFError:
        pass
    finally:
        agent.close()
        del groups
