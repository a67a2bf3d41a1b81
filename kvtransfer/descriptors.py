"""Pure functions from (src page, dst page) pairs to NIXL descriptors. No NIXL, no torch: numpy arrays only.

A pull moves, for each cache group, a list of page pairs (P's block/slot id -> D's block/slot id). Pairs are sorted
by source id and cut into runs where both ids step by one; one run of one region is one descriptor:

    src ids  3 4 5   9   12 13        runs (src_start, dst_start, n): (3, 20, 3) (9, 7, 1) (12, 30, 2)
    dst ids 20 21 22  7   30 31       descriptors per region: 3; for an attention group of L layers: 3 * L
                                      a recurrent group with one slot: 1 run * (conv + ssm) * L layers

Two ways to hand the runs to NIXL (the agent picks one, see `agent.AgentConfig.descriptor_mode`):
  * "per_transfer" (default, measured cheaper): a pull builds the coalesced byte descriptors (`byte_descs`) and
    NIXL prepares them.
  * "prepped": every page of every region is prepared once per peer (`page_dlist`, page granularity); a pull
    passes page indices (`page_indices`) and NIXL merges adjacent pages of a run back into one descriptor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .layout import CacheLayout, Region


class Run(NamedTuple):
    """`n` consecutive pages starting at `src_start` on the source and `dst_start` on the destination."""

    src_start: int
    dst_start: int
    n: int


def _ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids if ids.dtype == np.int64 else ids.astype(np.int64)
    return np.fromiter(ids, dtype=np.int64, count=len(ids))  # ~20% faster than asarray for lists of ints


def _has_duplicates(a: np.ndarray) -> bool:
    """Whether `a` repeats a value; O(n) when `a` is strictly increasing (the usual block list)."""
    if a.size < 2:
        return False
    steps = np.diff(a)
    if (steps > 0).all():
        return False
    return bool((np.diff(np.sort(a)) == 0).any())


def check_pairs(
    src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray, src_pages: int, dst_pages: int, what: str
) -> None:
    """Refuse pairs that would corrupt a cache: unequal counts, the null page 0, ids out of range, duplicates."""
    if len(src) != len(dst):
        raise ValueError(f"{what}: {len(src)} source ids but {len(dst)} destination ids")
    for ids, pages, side in ((src, src_pages, "source"), (dst, dst_pages, "destination")):
        a = _ids(ids)
        if a.size and (a.min() <= 0 or a.max() >= pages):
            bad = a[(a <= 0) | (a >= pages)]
            raise ValueError(f"{what}: {side} ids {bad[:8].tolist()} outside 1..{pages - 1} (0 is the null block)")
        if _has_duplicates(a):
            raise ValueError(f"{what}: duplicate {side} ids in {a[:16].tolist()}")


def coalesce_array(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> np.ndarray:
    """(k, 3) int64 rows (src_start, dst_start, n): the pairs sorted by source id, cut where either id jumps."""
    s, d = _ids(src), _ids(dst)
    if s.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    if not (np.diff(s) > 0).all():
        order = np.argsort(s, kind="stable")
        s, d = s[order], d[order]
    cut = np.ones(s.size, dtype=bool)
    cut[1:] = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.flatnonzero(cut)
    return np.stack([s[starts], d[starts], np.diff(np.append(starts, s.size))], axis=1)


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """`coalesce_array` as a list of `Run`s."""
    return [Run(int(a), int(b), int(n)) for a, b, n in coalesce_array(src, dst)]


def _split(runs: np.ndarray) -> np.ndarray:
    """Runs cut into single pages."""
    n = runs[:, 2]
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # position inside its run
    return np.stack([np.repeat(runs[:, 0], n) + k, np.repeat(runs[:, 1], n) + k, np.ones_like(k)], axis=1)


def region_runs(src_region: Region, dst_region: Region, runs: np.ndarray) -> np.ndarray:
    """The runs one descriptor each can carry between these two regions (split to single pages if strided)."""
    if src_region.page_bytes != dst_region.page_bytes:
        raise ValueError(f"{src_region.name}: page bytes {src_region.page_bytes} != {dst_region.page_bytes}")
    if src_region.pages_contiguous and dst_region.pages_contiguous:
        return runs
    return _split(runs)


@dataclass(frozen=True)
class PullPlan:
    """Everything one pull moves. `pairs[i]` = (src region, dst region, its (k, 3) runs array)."""

    pairs: tuple[tuple[Region, Region, np.ndarray], ...]
    bytes_by_kind: Mapping[str, int]

    @property
    def num_descriptors(self) -> int:
        return sum(len(runs) for _, _, runs in self.pairs)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_kind.values())


def plan_pull(
    src: CacheLayout, dst: CacheLayout, pages_by_group: Mapping[int, tuple[Sequence[int], Sequence[int]]]
) -> PullPlan:
    """Pair P's regions (`src`) with D's (`dst`) by name and cut each group's page pairs into runs."""
    dst_by_name = {r.name: r for r in dst.regions}
    pairs: list[tuple[Region, Region, np.ndarray]] = []
    nbytes: dict[str, int] = {}
    for gid, (src_list, dst_list) in sorted(pages_by_group.items()):
        src_ids, dst_ids = _ids(src_list), _ids(dst_list)  # converted once, checked and coalesced as arrays
        check_pairs(src_ids, dst_ids, src.num_pages(gid), dst.num_pages(gid), f"group {gid}")
        runs = coalesce_array(src_ids, dst_ids)
        kind = src.kind(gid)
        for s in src.regions_of(gid):
            d = dst_by_name[s.name]
            pairs.append((s, d, region_runs(s, d, runs)))
            nbytes[kind] = nbytes.get(kind, 0) + len(src_ids) * s.page_bytes
    return PullPlan(tuple(pairs), nbytes)


def split_plan(plan: PullPlan, parts: int) -> list[PullPlan]:
    """Cut `plan` into at most `parts` plans of about equal bytes, in order, for READs posted side by side. Cuts
    fall on the page boundary nearest to each k/parts of the bytes (a run may be cut in two); every page of `plan`
    lands in exactly one part. Parts carry their bytes under the kind "part" (callers report the whole plan)."""
    if parts <= 1 or plan.num_descriptors == 0:
        return [plan]
    total = sum(int((runs[:, 2] * s.page_bytes).sum()) for s, _, runs in plan.pairs)
    cuts = [total * k / parts for k in range(1, parts)] + [float("inf")]
    out: list[PullPlan] = []
    cur: list[tuple[Region, Region, np.ndarray]] = []
    rows: list[list[int]] = []
    offset = part_start = 0

    for s, d, runs in plan.pairs:
        pb = s.page_bytes
        for src_start, dst_start, n in runs.tolist():
            while n:
                if offset > part_start and offset >= cuts[0] - pb / 2:  # nearest boundary reached: close the part
                    if rows:
                        cur.append((s, d, np.asarray(rows, dtype=np.int64)))
                    out.append(PullPlan(tuple(cur), {"part": offset - part_start}))
                    cur, rows, part_start = [], [], offset
                    cuts.pop(0)
                take = n if cuts[0] == float("inf") else min(n, max(1, round((cuts[0] - offset) / pb)))
                rows.append([src_start, dst_start, take])
                offset += take * pb
                src_start, dst_start, n = src_start + take, dst_start + take, n - take
        if rows:
            cur.append((s, d, np.asarray(rows, dtype=np.int64)))
            rows = []
    out.append(PullPlan(tuple(cur), {"part": offset - part_start}))
    return out


def byte_descs(plan: PullPlan, side: str) -> np.ndarray:
    """(N, 3) uint64 rows (addr, len, device id), one per (region, run) in plan order, for `side` "src" or "dst".
    Pairs sharing one runs array (the layers of a group) are computed together: a few numpy calls per group."""
    col, which = (0, 0) if side == "src" else (1, 1)
    pairs, rows, i = plan.pairs, [], 0
    while i < len(pairs):
        runs, j = pairs[i][2], i + 1
        while j < len(pairs) and pairs[j][2] is runs:
            j += 1
        regs = [p[which] for p in pairs[i:j]]
        attrs = np.asarray([(r.base_addr, r.page_stride, r.page_bytes, r.device_id) for r in regs], dtype=np.int64)
        block = np.empty((j - i, len(runs), 3), dtype=np.int64)
        block[:, :, 0] = attrs[:, :1] + runs[:, col] * attrs[:, 1:2]
        block[:, :, 1] = runs[:, 2] * attrs[:, 2:3]
        block[:, :, 2] = attrs[:, 3:4]
        rows.append(block.reshape(-1, 3))
        i = j
    return np.concatenate(rows).astype(np.uint64) if rows else np.empty((0, 3), dtype=np.uint64)


def region_offsets(layout: CacheLayout) -> dict[str, int]:
    """Index of each region's page 0 in the layout's page list (`page_dlist`)."""
    out, off = {}, 0
    for r in layout.regions:
        out[r.name] = off
        off += r.num_pages
    return out


def page_dlist(layout: CacheLayout) -> np.ndarray:
    """(R, 5) uint64 strided rows (addr, page_bytes, device id, stride, count): every page of every region, in
    layout order, as NIXL's compressed descriptor list (expanded by NIXL to one descriptor per page)."""
    return np.asarray(
        [(r.base_addr, r.page_bytes, r.device_id, r.page_stride, r.num_pages) for r in layout.regions],
        dtype=np.uint64,
    ).reshape(-1, 5)


def page_indices(plan: PullPlan, offsets: Mapping[str, int], side: str) -> np.ndarray:
    """int32 indices into `page_dlist` of every page the plan moves, run by run, for `side` "src" or "dst"."""
    col = 0 if side == "src" else 1
    parts: list[np.ndarray] = []
    for s, _, runs in plan.pairs:
        starts, n = runs[:, col], runs[:, 2]
        # page k of the concatenated runs = its run's start + (k - pages before that run)
        parts.append(offsets[s.name] + np.arange(int(n.sum())) + np.repeat(starts - (np.cumsum(n) - n), n))
    return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, dtype=np.int32)


def flatten(groups: Iterable[Mapping[int, Sequence[int]]]) -> dict[int, list[int]]:
    """Merge several {group id: ids} maps (e.g. attention blocks and state slots) into one; groups must not repeat."""
    out: dict[int, list[int]] = {}
    for g in groups:
        for gid, ids in g.items():
            if gid in out:
                raise ValueError(f"group {gid} given twice")
            out[gid] = list(ids)
    return out
