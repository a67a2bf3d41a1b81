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

import functools
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


def _table(regions: Sequence[Region]) -> np.ndarray:
    """(R, 4) int64 rows (base address, page stride, page bytes, device id), one per region."""
    return np.asarray([(r.base_addr, r.page_stride, r.page_bytes, r.device_id) for r in regions], dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Route:
    """Regions of one group paired by name (P's `src[i]` <-> D's `dst[i]`), with their address tables. When
    `contiguous` is False a run cannot be one descriptor: runs are cut into single pages."""

    src: tuple[Region, ...]
    dst: tuple[Region, ...]
    contiguous: bool
    src_table: np.ndarray
    dst_table: np.ndarray
    page_bytes: int  # bytes of one page summed over the regions
    src_rows: tuple[tuple[int, int, int, int], ...]  # the tables as Python ints (small pulls skip numpy)
    dst_rows: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def of(cls, src: Sequence[Region], dst: Sequence[Region]) -> Route:
        for s, d in zip(src, dst, strict=True):
            if s.page_bytes != d.page_bytes:
                raise ValueError(f"{s.name}: page bytes {s.page_bytes} != {d.page_bytes}")
        contiguous = all(s.pages_contiguous and d.pages_contiguous for s, d in zip(src, dst, strict=True))
        st, dt = _table(src), _table(dst)
        rows = (tuple(map(tuple, st.tolist())), tuple(map(tuple, dt.tolist())))
        return cls(tuple(src), tuple(dst), contiguous, st, dt, sum(s.page_bytes for s in src), *rows)


def routes(src: CacheLayout, dst: CacheLayout, gid: int) -> tuple[Route, ...]:
    """The group's regions paired by name, split into a contiguous and a strided route where they differ. Computed
    once per (P layout, D layout, group) and kept on P's layout object (it lives as long as the peer)."""
    cache = src._routes_cache
    hit = cache.get((id(dst), gid))
    if hit is not None and hit[0] is dst:
        return hit[1]
    dst_by_name = {r.name: r for r in dst.regions_of(gid)}
    pairs = []
    for s in src.regions_of(gid):
        d = dst_by_name.get(s.name)
        if d is None:
            raise ValueError(f"group {gid}: region {s.name} missing on the destination")
        pairs.append((s, d))
    out = []
    for contiguous in (True, False):
        sel = [(s, d) for s, d in pairs if (s.pages_contiguous and d.pages_contiguous) == contiguous]
        if sel:
            out.append(Route.of([s for s, _ in sel], [d for _, d in sel]))
    cache[(id(dst), gid)] = (dst, tuple(out))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """The runs every region of `route` moves: (k, 3) int64 rows (src page, dst page, pages), one descriptor each
    per region."""

    route: Route
    runs: np.ndarray

    @property
    def num_descriptors(self) -> int:
        return len(self.route.src) * len(self.runs)


@dataclass(frozen=True)
class PullPlan:
    """Everything one pull moves: per route, its runs; `bytes_by_kind` per group kind (metrics)."""

    groups: tuple[GroupPlan, ...]
    bytes_by_kind: Mapping[str, int]

    @classmethod
    def from_pairs(
        cls, pairs: Iterable[tuple[Region, Region, np.ndarray]], bytes_by_kind: Mapping[str, int]
    ) -> PullPlan:
        """A plan from (src region, dst region, runs) triples; consecutive triples sharing one runs array form
        one group plan."""
        groups: list[GroupPlan] = []
        cur: list[tuple[Region, Region, np.ndarray]] = []
        for p in [*pairs, None]:
            if cur and (p is None or p[2] is not cur[0][2]):
                groups.append(GroupPlan(Route.of([s for s, _, _ in cur], [d for _, d, _ in cur]), cur[0][2]))
                cur = []
            if p is not None:
                cur.append(p)
        return cls(tuple(groups), bytes_by_kind)

    @property
    def pairs(self) -> tuple[tuple[Region, Region, np.ndarray], ...]:
        """(src region, dst region, runs) per region, in descriptor order."""
        return tuple((s, d, g.runs) for g in self.groups for s, d in zip(g.route.src, g.route.dst, strict=True))

    @functools.cached_property
    def num_descriptors(self) -> int:
        return sum(g.num_descriptors for g in self.groups)

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(self.bytes_by_kind.values())


_SMALL = 16  # at most this many pages: check and coalesce in plain Python (numpy's per-call cost dominates)
_LIST_RUN = 1024  # up to this many ids in lists, test for one run by list comparison (faster than numpy below it)


def _refuse(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray, sp: int, dp: int, what: str) -> None:
    """A fast path found bad ids: raise `check_pairs`' error for them (the same message the general path gives)."""
    check_pairs(src, dst, sp, dp, what)
    raise AssertionError("check_pairs accepted ids a fast path refused")  # pragma: no cover


def group_runs(
    src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray, src_pages: int, dst_pages: int, what: str
) -> np.ndarray:
    """`check_pairs` then `coalesce_array`, with fast paths for the usual shapes: a few pages (state slots) and
    one run of consecutive ids on both sides (a fresh prompt on fresh pools). Same result and errors."""
    n = len(src)
    if n != len(dst) or n == 0:
        check_pairs(src, dst, src_pages, dst_pages, what)
        return np.empty((0, 3), dtype=np.int64)
    if n <= _SMALL and not isinstance(src, np.ndarray) and not isinstance(dst, np.ndarray):
        si, di = [int(x) for x in src], [int(x) for x in dst]
        if (
            min(si) <= 0 or max(si) >= src_pages or min(di) <= 0 or max(di) >= dst_pages
            or len(set(si)) < n or len(set(di)) < n
        ):
            _refuse(si, di, src_pages, dst_pages, what)
        rows: list[list[int]] = []
        for a, b in sorted(zip(si, di, strict=True)):
            last = rows[-1] if rows else None
            if last is not None and a == last[0] + last[2] and b == last[1] + last[2]:
                last[2] += 1
            else:
                rows.append([a, b, 1])
        return np.asarray(rows, dtype=np.int64)
    if n <= _LIST_RUN and isinstance(src, list) and isinstance(dst, list):
        a, b = src[0], dst[0]  # one run, compared in C against a range: cheaper than converting to arrays
        if type(a) is int and type(b) is int and src == list(range(a, a + n)) and dst == list(range(b, b + n)):
            if a <= 0 or a + n > src_pages or b <= 0 or b + n > dst_pages:
                _refuse(src, dst, src_pages, dst_pages, what)
            return np.asarray([[a, b, n]], dtype=np.int64)
    s, d = _ids(src), _ids(dst)
    s0, d0 = int(s[0]), int(d[0])
    if (
        int(s[-1]) - s0 == n - 1 and int(d[-1]) - d0 == n - 1
        and (s[1:] - s[:-1] == 1).all() and (d[1:] - d[:-1] == 1).all()
    ):  # one run: ids strictly increasing by one, so no duplicates; only the ends need a range check
        if s0 <= 0 or s0 + n > src_pages or d0 <= 0 or d0 + n > dst_pages:
            _refuse(s, d, src_pages, dst_pages, what)
        return np.asarray([[s0, d0, n]], dtype=np.int64)
    check_pairs(s, d, src_pages, dst_pages, what)
    return coalesce_array(s, d)


def plan_pull(
    src: CacheLayout, dst: CacheLayout, pages_by_group: Mapping[int, tuple[Sequence[int], Sequence[int]]]
) -> PullPlan:
    """Pair P's regions (`src`) with D's (`dst`) by name and cut each group's page pairs into runs."""
    groups: list[GroupPlan] = []
    nbytes: dict[str, int] = {}
    for gid in sorted(pages_by_group):
        src_list, dst_list = pages_by_group[gid]
        runs = group_runs(src_list, dst_list, src.num_pages(gid), dst.num_pages(gid), f"group {gid}")
        kind = src.kind(gid)
        for route in routes(src, dst, gid):
            groups.append(GroupPlan(route, runs if route.contiguous else _split(runs)))
            nbytes[kind] = nbytes.get(kind, 0) + len(src_list) * route.page_bytes
    return PullPlan(tuple(groups), nbytes)


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
                    out.append(PullPlan.from_pairs(cur, {"part": offset - part_start}))
                    cur, rows, part_start = [], [], offset
                    cuts.pop(0)
                take = n if cuts[0] == float("inf") else min(n, max(1, round((cuts[0] - offset) / pb)))
                rows.append([src_start, dst_start, take])
                offset += take * pb
                src_start, dst_start, n = src_start + take, dst_start + take, n - take
        if rows:
            cur.append((s, d, np.asarray(rows, dtype=np.int64)))
            rows = []
    out.append(PullPlan.from_pairs(cur, {"part": offset - part_start}))
    return out


_FEW_DESCRIPTORS = 64  # up to this many descriptors, plain Python builds them faster than numpy's per-call cost


def byte_descs(plan: PullPlan, side: str) -> np.ndarray:
    """(N, 3) uint64 rows (addr, len, device id), one per (region, run) in plan order, for `side` "src" or "dst".
    Built from each route's precomputed address table (a few numpy operations per group plan)."""
    col = 0 if side == "src" else 1
    if plan.num_descriptors <= _FEW_DESCRIPTORS:
        rows = [
            (base + run[col] * stride, run[2] * page_bytes, dev)
            for g in plan.groups
            for base, stride, page_bytes, dev in (g.route.src_rows if col == 0 else g.route.dst_rows)
            for run in g.runs.tolist()
        ]
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)
    blocks = []
    for g in plan.groups:
        t, runs = (g.route.src_table if col == 0 else g.route.dst_table), g.runs
        block = np.empty((len(t), len(runs), 3), dtype=np.int64)
        block[:, :, 0] = t[:, :1] + runs[:, col] * t[:, 1:2]
        block[:, :, 1] = runs[:, 2] * t[:, 2:3]
        block[:, :, 2] = t[:, 3:4]
        blocks.append(block.reshape(-1, 3))
    return (blocks[0] if len(blocks) == 1 else np.concatenate(blocks)).view(np.uint64)


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
