"""The tensor-parallel process group of one worker and the few collectives the model and the executor use.

Ranks are processes on one host: rank r of a worker on `cuda:N` runs on `cuda:N+r`; on CPU every rank runs on the
CPU. Tensors move over `group` (NCCL on CUDA, gloo on CPU); Python objects that every rank contributes (the cache
budget, the plans, `gather_objects`) move over `control`, a gloo group in both cases. Rank 0's commands (the step
each rank executes: `broadcast`) move over `channel` (engine.parallel.channel: one Unix-socket message per
follower, sent without waiting for it), set up by `init_tp` through the control group. Neither touches the GPU
stream.
Ownership: `init_tp` is called once per process before the model is loaded; the group lives as long as the process
(rank 0 closes the channel when it stops its followers).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from hybridpd.engine.parallel.channel import FollowerChannel, LeaderChannel, Listener, connect

AddNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(x, weight, eps, zero_centered, residual) -> (normed, h), as engine.kernels.fused.rms_norm."""


class BlockReduce:
    """What a model and its row-parallel hooks share: inside `scope`, block outputs stay partial sums (the hooks
    return them as they are) and the model's residual norms sum them over the ranks (`fused`: an
    engine.parallel.fused_allreduce.FusedReduceNorm, None: NCCL in the hooks for every step)."""

    def __init__(self) -> None:
        self.fused: Any = None
        self.active = False

    @contextlib.contextmanager
    def scope(self, rows: int, dtype: torch.dtype) -> Iterator[AddNorm]:
        """The residual norm of one forward of `rows` rows: the fused kernel when it serves them, else rms_norm
        (and the hooks all-reduce). Every rank chooses alike: rows and dtype are the same on all of them."""
        from hybridpd.engine.kernels.fused import rms_norm

        f = self.fused
        if f is None or self.active or rows > f.max_rows or dtype != f.dtype:
            yield rms_norm
            return
        f.begin()
        self.active = True
        try:
            yield f
        finally:
            self.active = False


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its worker's tensor-parallel group."""

    rank: int
    world: int
    group: Any  # torch.distributed ProcessGroup for tensors
    control: Any  # gloo ProcessGroup for objects
    channel: LeaderChannel | FollowerChannel | None = None
    """Rank 0's commands: its LeaderChannel on rank 0, a FollowerChannel on the others (None: no commands)."""
    block_reduce: BlockReduce = field(default_factory=BlockReduce, compare=False)
    """How block ends are summed over the ranks in a batched forward (engine.parallel.fused_allreduce)."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_first(self, x: torch.Tensor) -> torch.Tensor:
        """Stack every rank's x along a new first dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def broadcast_tokens(self, tokens: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
        """Rank 0's `n` sampled token ids (int64, on the device) on every rank (others pass None). Enqueued on the
        device like the model's collectives: nobody waits for it on the host."""
        if tokens is None:
            tokens = torch.empty(n, dtype=torch.int64, device=device)
        dist.broadcast(tokens, src=0, group=self.group)
        return tokens

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (the cache budget all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's obj on every rank, in the order rank 0 sent them (others pass None and wait for the next one).
        Rank 0 returns at once (obj is pickled before it returns; the followers may not have it yet): the ranks
        meet in the collectives of the commands they run."""
        if isinstance(self.channel, LeaderChannel):
            self.channel.send(obj)
            return obj
        if isinstance(self.channel, FollowerChannel):
            return self.channel.recv()
        raise RuntimeError("this tensor-parallel group has no command channel")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` for a worker configured on `device`: cuda:N -> cuda:N+rank; cpu stays cpu."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def init_tp(rank: int, world: int, init_method: str, device: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the worker's group (blocks until all `world` ranks joined). NCCL on CUDA, gloo on CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    group = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else group
    return TPGroup(rank, world, group, control, open_channel(rank, world, control, timeout_s))


def open_channel(rank: int, world: int, control: Any, timeout_s: float) -> LeaderChannel | FollowerChannel:
    """The command channel of the group: rank 0 listens and tells the others where over `control`."""
    if rank == 0:
        listener = Listener()
        try:
            dist.broadcast_object_list([listener.address], src=0, group=control)
            return LeaderChannel(listener.accept(world, timeout_s))
        finally:
            listener.close()
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return connect(box[0], rank, timeout_s)


__all__ = ["BlockReduce", "TPGroup", "free_port", "init_tp", "open_channel", "rank_device"]
