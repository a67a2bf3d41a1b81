"""Where a worker's cache pages live in memory, described without tensors, and whether two workers can trade them.

The engine allocates its caches (it owns the tensors and their lifetime); it describes them once, after allocation,
with `CacheLayout.from_tensors` (or builds `Region`s itself) and hands the layout to `TransferAgent`. Nothing here
keeps a tensor alive: the engine must keep the tensors alive, and at the same addresses, as long as the agent lives.

One region = the pages of one tensor of one layer, or of every layer of a group when the engine stacks them
(`GroupTensors.stacked`, what the engine does). A group's block (attention) or state slot (recurrent) id `i` names
page `i` of every region of that group:

    attention layer:  [num_blocks, 2, block_size, kv_heads, head_dim]  -> region "g0.l3.kv"
    recurrent layer:  conv [num_slots, ...], ssm [num_slots, ...]      -> regions "g1.l0.conv", "g1.l0.ssm"
    stacked group:    [num_blocks, layers, 2, block_size, ...]         -> region "g0.stacked.kv" (page = all layers)

    base_addr                      page i                              (page 0 = null block, never transferred)
    |<- page_stride ->|            |<- page_bytes ->|
    [ page 0 ][ page 1 ] ... [     page i      ] ...        page i starts at base_addr + i * page_stride

Pages of a block-major tensor are back to back (page_stride == page_bytes), so a run of consecutive ids is one
contiguous byte range: one transfer descriptor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1
"""Version of the metadata wire format and of the pull/release protocol. Bump on any incompatible change."""

ATTENTION = "attention"
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Region:
    """The pages of one tensor of one layer: page `i` is `page_bytes` long, at `base_addr + i * page_stride`."""

    name: str
    group_id: int
    layer_id: int
    base_addr: int
    page_bytes: int
    page_stride: int
    num_pages: int
    device_type: str = "cpu"
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"region {self.name}: device_type {self.device_type!r} not in {DEVICE_TYPES}")
        if self.page_bytes <= 0 or self.page_stride < self.page_bytes or self.num_pages <= 0:
            raise ValueError(
                f"region {self.name}: need page_bytes > 0, page_stride >= page_bytes, num_pages > 0 "
                f"(got {self.page_bytes}, {self.page_stride}, {self.num_pages})"
            )

    @property
    def span_bytes(self) -> int:
        """Bytes from the first page's start to the last page's end: what gets registered."""
        return self.page_stride * (self.num_pages - 1) + self.page_bytes

    @property
    def pages_contiguous(self) -> bool:
        """True when consecutive pages are back to back, so runs of pages coalesce into one descriptor."""
        return self.page_stride == self.page_bytes

    def page_addr(self, page: int) -> int:
        return self.base_addr + page * self.page_stride

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Region:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


class GroupTensors(NamedTuple):
    """Input of `CacheLayout.from_tensors` for one cache group.

    `tensors` has one entry per layer: a tensor (attention: [num_blocks, 2, block_size, kv_heads, head_dim]) or a
    sequence of tensors (recurrent: conv [num_slots, ...], ssm [num_slots, ...]). `layer_ids` default to 0..n-1.

    `stacked=True`: the group's layers share one tensor per kind with the layer as dimension 1 (attention:
    [num_blocks, layers, 2, block_size, kv_heads, head_dim]; recurrent: conv [num_slots, layers, ...], ssm
    [num_slots, layers, ...]) and `tensors` has exactly one entry. A page is then a block of every layer, so a run
    of blocks is one descriptor for the whole group instead of one per layer."""

    group_id: int
    kind: str
    tensors: Sequence[Any]
    layer_ids: Sequence[int] | None = None
    stacked: bool = False


def _tensor_names(kind: str, n: int) -> tuple[str, ...]:
    if kind == ATTENTION and n == 1:
        return ("kv",)
    if n == 2:
        return ("conv", "ssm")
    return tuple(f"t{i}" for i in range(n))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _region_of(name: str, group_id: int, layer_id: int, t: torch.Tensor) -> Region:
    if t.dim() < 1 or t.shape[0] < 1:
        raise ValueError(f"{name}: need a tensor [num_pages, ...] with num_pages >= 1, got shape {tuple(t.shape)}")
    if not t[0].is_contiguous():
        raise ValueError(f"{name}: one page (tensor[i]) must be contiguous; strides {t.stride()}")
    elem = t.element_size()
    page_bytes = math.prod(t.shape[1:]) * elem
    return Region(
        name=name,
        group_id=group_id,
        layer_id=layer_id,
        base_addr=t.data_ptr(),
        page_bytes=page_bytes,
        page_stride=t.stride(0) * elem if t.shape[0] > 1 else page_bytes,
        num_pages=int(t.shape[0]),
        device_type=t.device.type,
        device_id=t.device.index or 0,
    )


def _fingerprint_of(g: GroupTensors, layer_ids: Sequence[int], per_layer: Sequence[Sequence[Any]]) -> dict[str, str]:
    fp = {f"group.{g.group_id}.kind": g.kind, f"group.{g.group_id}.layers": ",".join(map(str, layer_ids))}
    first = per_layer[0][0]
    if g.kind == ATTENTION and first.dim() == 5:
        fp[f"group.{g.group_id}.block_size"] = str(first.shape[2])
    for lid, ts in zip(layer_ids, per_layer, strict=True):
        for tname, t in zip(_tensor_names(g.kind, len(ts)), ts, strict=True):
            page_bytes = math.prod(t.shape[1:]) * t.element_size()
            fp[f"group.{g.group_id}.layer.{lid}.{tname}"] = (
                f"dtype={_dtype_name(t)} page_shape={tuple(t.shape[1:])} page_bytes={page_bytes}"
            )
    return fp


@dataclass(frozen=True)
class CacheLayout:
    """A worker's cache regions plus the compatibility fingerprint two workers must share to trade pages.

    `fingerprint` is what the hash covers (protocol version, model id, per group kind/layers/block size, per tensor
    dtype/page shape/page bytes, and the engine's `extra` entries); it travels in the metadata so a mismatch can be
    reported key by key. Addresses and page counts are not part of it: P and D may size their pools differently."""

    regions: tuple[Region, ...]
    group_kinds: Mapping[int, str]
    fingerprint: Mapping[str, str] = field(default_factory=dict)
    compat_hash: str = ""

    def __post_init__(self) -> None:
        if not self.compat_hash:
            object.__setattr__(self, "compat_hash", compat_hash(self.fingerprint))
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate region names in {names}")
        if len({r.device_type for r in self.regions}) > 1:
            raise ValueError("all regions of one worker must live on one device type")
        for gid in self.group_ids:
            if gid not in self.group_kinds:
                raise ValueError(f"group {gid} has regions but no kind")
            if len({r.num_pages for r in self.regions_of(gid)}) != 1:
                raise ValueError(f"group {gid}: all regions must have the same number of pages")

    @classmethod
    def from_tensors(
        cls,
        groups: Sequence[GroupTensors | tuple[Any, ...]],
        *,
        model_id: str,
        extra: Mapping[str, str] | None = None,
    ) -> CacheLayout:
        """Describe the engine's cache tensors. `extra` adds engine-chosen entries to the fingerprint (e.g. the
        repr of each group's spec, the checkpoint interval) so that any difference in them refuses the handshake."""
        regions: list[Region] = []
        kinds: dict[int, str] = {}
        fp: dict[str, str] = {"protocol": str(PROTOCOL_VERSION), "model_id": model_id}
        for raw in groups:
            g = GroupTensors(*raw)
            entries = [[t] if hasattr(t, "data_ptr") else list(t) for t in g.tensors]
            if not entries:
                raise ValueError(f"group {g.group_id} has no layers")
            kinds[g.group_id] = g.kind
            if g.stacked:
                if len(entries) != 1:
                    raise ValueError(f"group {g.group_id}: a stacked group has one entry, got {len(entries)}")
                stack = entries[0]
                n = {int(t.shape[1]) if t.dim() >= 2 else 0 for t in stack}
                if len(n) != 1 or 0 in n:
                    raise ValueError(f"group {g.group_id}: stacked tensors need one layer count in dim 1, got {n}")
                num_layers = n.pop()
                layer_ids = list(g.layer_ids) if g.layer_ids is not None else list(range(num_layers))
                if len(layer_ids) != num_layers:
                    raise ValueError(f"group {g.group_id}: {len(layer_ids)} layer ids for {num_layers} layers")
                for tname, t in zip(_tensor_names(g.kind, len(stack)), stack, strict=True):
                    regions.append(_region_of(f"g{g.group_id}.stacked.{tname}", g.group_id, layer_ids[0], t))
                per_layer = [[t[:, i] for t in stack] for i in range(num_layers)]
                fp[f"group.{g.group_id}.stacked"] = "layers"
            else:
                per_layer = entries
                layer_ids = list(g.layer_ids) if g.layer_ids is not None else list(range(len(per_layer)))
                if len(layer_ids) != len(per_layer):
                    raise ValueError(f"group {g.group_id}: {len(layer_ids)} layer ids for {len(per_layer)} layers")
                for lid, ts in zip(layer_ids, per_layer, strict=True):
                    for tname, t in zip(_tensor_names(g.kind, len(ts)), ts, strict=True):
                        regions.append(_region_of(f"g{g.group_id}.l{lid}.{tname}", g.group_id, lid, t))
            fp.update(_fingerprint_of(g, layer_ids, per_layer))
        fp.update({f"extra.{k}": str(v) for k, v in (extra or {}).items()})
        return cls(regions=tuple(regions), group_kinds=kinds, fingerprint=fp)

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(sorted({r.group_id for r in self.regions}))

    @property
    def device_type(self) -> str:
        return self.regions[0].device_type if self.regions else "cpu"

    def regions_of(self, group_id: int) -> tuple[Region, ...]:
        return self._by_group.get(group_id, ())

    @functools.cached_property
    def _by_group(self) -> dict[int, tuple[Region, ...]]:
        out: dict[int, list[Region]] = {}
        for r in self.regions:
            out.setdefault(r.group_id, []).append(r)
        return {g: tuple(rs) for g, rs in out.items()}

    @functools.cached_property
    def _routes_cache(self) -> dict[tuple[int, int], Any]:
        """`descriptors.routes` memo (this layout as the source side): {(id(dst layout), group): (dst, routes)}."""
        return {}

    def kind(self, group_id: int) -> str:
        return self.group_kinds[group_id]

    def is_attention(self, group_id: int) -> bool:
        return self.group_kinds[group_id] == ATTENTION

    def num_pages(self, group_id: int) -> int:
        return self.regions_of(group_id)[0].num_pages

    def diff(self, other: CacheLayout) -> list[str]:
        """Human-readable differences of the two fingerprints, e.g. "model_id: 'a' (here) != 'b' (peer)"."""
        out = []
        for key in sorted(set(self.fingerprint) | set(other.fingerprint)):
            mine, theirs = self.fingerprint.get(key, "<absent>"), other.fingerprint.get(key, "<absent>")
            if mine != theirs:
                out.append(f"{key}: {mine!r} (here) != {theirs!r} (peer)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "regions": [r.to_dict() for r in self.regions],
            "group_kinds": {str(k): v for k, v in self.group_kinds.items()},
            "fingerprint": dict(self.fingerprint),
            "compat_hash": self.compat_hash,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheLayout:
        return cls(
            regions=tuple(Region.from_dict(r) for r in d["regions"]),
            group_kinds={int(k): str(v) for k, v in d["group_kinds"].items()},
            fingerprint={str(k): str(v) for k, v in d["fingerprint"].items()},
            compat_hash=str(d["compat_hash"]),
        )


def compat_hash(fingerprint: Mapping[str, str]) -> str:
    """sha256 (hex, 32 chars) over the sorted fingerprint entries."""
    blob = json.dumps(sorted(fingerprint.items()), separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
