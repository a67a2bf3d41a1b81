"""kvtransfer descriptors: run coalescing and descriptor building are pure; exact runs, counts, addresses."""

from __future__ import annotations

import numpy as np
import pytest
from hybridpd.kvtransfer import descriptors
from hybridpd.kvtransfer.descriptors import (
    PullPlan,
    Run,
    byte_descs,
    check_pairs,
    coalesce,
    coalesce_array,
    flatten,
    group_runs,
    page_dlist,
    page_indices,
    plan_pull,
    region_offsets,
    split_plan,
)
from hybridpd.kvtransfer.layout import CacheLayout, Region


def layout(base: int, attn_pages: int = 40, slots: int = 6, stride_pad: int = 0) -> CacheLayout:
    """Two attention layers (page 1 KiB) and one recurrent layer (conv 96 B + ssm 256 B), fake addresses."""
    regions = (
        Region("g0.l0.kv", 0, 0, base, 1024, 1024 + stride_pad, attn_pages),
        Region("g0.l1.kv", 0, 1, base + 0x100000, 1024, 1024 + stride_pad, attn_pages),
        Region("g1.l5.conv", 1, 5, base + 0x200000, 96, 96, slots),
        Region("g1.l5.ssm", 1, 5, base + 0x300000, 256, 256, slots),
    )
    return CacheLayout(regions, {0: "attention", 1: "mamba2"}, {"model_id": "m"})


def test_coalesce_cuts_runs_where_either_side_jumps() -> None:
    assert coalesce([3, 4, 5, 9, 12, 13], [20, 21, 22, 7, 30, 31]) == [Run(3, 20, 3), Run(9, 7, 1), Run(12, 30, 2)]
    assert coalesce([1, 2, 3], [5, 6, 8]) == [Run(1, 5, 2), Run(3, 8, 1)]
    assert coalesce([1, 2, 3], [3, 2, 1]) == [Run(1, 3, 1), Run(2, 2, 1), Run(3, 1, 1)]
    assert coalesce([], []) == []


def test_coalesce_sorts_pairs_by_source() -> None:
    assert coalesce([5, 3, 4], [12, 10, 11]) == [Run(3, 10, 3)]


@pytest.mark.parametrize(
    ("src", "dst", "msg"),
    [
        ([1, 2], [1], "2 source ids but 1"),
        ([0, 2], [1, 2], "outside 1..39"),
        ([1, 2], [1, 40], "destination ids [40]"),
        ([1, 1], [2, 3], "duplicate source"),
        ([1, 2], [3, 3], "duplicate destination"),
    ],
)
def test_check_pairs_refuses_bad_ids(src: list[int], dst: list[int], msg: str) -> None:
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        check_pairs(src, dst, 40, 40, "group 0")


def test_plan_counts_runs_times_regions_and_bytes() -> None:
    p, d = layout(0x10000000), layout(0x70000000, attn_pages=50, slots=9)
    plan = plan_pull(p, d, {0: ([3, 4, 5, 9, 12, 13], [20, 21, 22, 7, 30, 31]), 1: ([2], [5])})
    assert plan.num_descriptors == 3 * 2 + 1 * 2
    assert plan.bytes_by_kind == {"attention": 6 * 2 * 1024, "mamba2": 96 + 256}
    src, dst = byte_descs(plan, "src"), byte_descs(plan, "dst")
    assert src.shape == dst.shape == (8, 3)
    assert src[0].tolist() == [0x10000000 + 3 * 1024, 3 * 1024, 0]
    assert dst[0].tolist() == [0x70000000 + 20 * 1024, 3 * 1024, 0]
    assert src[3].tolist() == [0x10100000 + 3 * 1024, 3 * 1024, 0]  # layer 1, first run
    assert src[6].tolist() == [0x10200000 + 2 * 96, 96, 0]  # conv slot 2
    assert dst[7].tolist() == [0x70300000 + 5 * 256, 256, 0]  # ssm slot 5
    assert int(src[:, 1].sum()) == plan.nbytes


def test_strided_pages_are_not_coalesced() -> None:
    p, d = layout(0x10000000, stride_pad=64), layout(0x70000000)
    plan = plan_pull(p, d, {0: ([3, 4, 5], [3, 4, 5])})
    assert plan.num_descriptors == 3 * 2
    assert byte_descs(plan, "src")[:3, 0].tolist() == [0x10000000 + i * 1088 for i in (3, 4, 5)]


def test_page_list_and_indices_address_the_same_bytes_as_byte_descs() -> None:
    p, d = layout(0x10000000), layout(0x70000000, attn_pages=50, slots=9)
    plan = plan_pull(p, d, {0: ([7, 8, 2], [1, 2, 9]), 1: ([4], [1])})
    for lay, side in ((p, "src"), (d, "dst")):
        page_addr = [r.base_addr + i * r.page_stride for r in lay.regions for i in range(r.num_pages)]
        by_index = [page_addr[i] for i in page_indices(plan, region_offsets(lay), side)]
        page_size = {r.base_addr + i * r.page_stride: r.page_bytes for r in lay.regions for i in range(r.num_pages)}
        expanded = []
        for addr, n, _ in byte_descs(plan, side).tolist():
            while n:
                expanded.append(addr)
                n -= page_size[addr]
                addr += page_size[addr]
        assert by_index == expanded
    assert page_dlist(p).tolist()[0] == [0x10000000, 1024, 0, 1024, 40]


def test_plan_rejects_mismatched_page_bytes() -> None:
    p = layout(0x10000000)
    half = (Region("g0.l0.kv", 0, 0, 0x5000, 512, 512, 40), Region("g0.l1.kv", 0, 1, 0x9000, 512, 512, 40))
    other = CacheLayout(half, {0: "attention"}, {})
    with pytest.raises(ValueError, match="page bytes 1024 != 512"):
        plan_pull(p, other, {0: ([1], [1])})


def test_flatten_merges_group_maps() -> None:
    assert flatten([{0: [1, 2]}, {1: [3]}]) == {0: [1, 2], 1: [3]}
    with pytest.raises(ValueError, match="group 0 given twice"):
        flatten([{0: [1]}, {0: [2]}])


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8, 64])
def test_split_plan_moves_every_byte_once_in_about_equal_parts(parts: int) -> None:
    a, b = Region("a", 0, 0, 0x1000, 100, 100, 64), Region("b", 0, 1, 0x90000, 100, 100, 64)
    runs = np.asarray([[1, 2, 10], [20, 30, 3], [40, 50, 1]], dtype=np.int64)
    plan = PullPlan.from_pairs(((a, a, runs), (b, b, runs)), {"attention": 2 * 14 * 100})
    out = split_plan(plan, parts)
    assert 1 <= len(out) <= parts and sum(p.nbytes for p in out) == plan.nbytes

    def byte_set(descs: np.ndarray) -> list[int]:
        return sorted(x for addr, n, _ in descs.tolist() for x in range(addr, addr + n, 100))

    for side in ("src", "dst"):
        assert byte_set(np.concatenate([byte_descs(p, side) for p in out])) == byte_set(byte_descs(plan, side))
    if parts <= 28:  # 28 pages of 100 bytes: cuts on the page boundary nearest each k/parts of the bytes
        assert len(out) == parts
        assert all(abs(p.nbytes - plan.nbytes / parts) <= 100 for p in out)


def _reference_runs(src: list[int], dst: list[int], pages: int) -> np.ndarray | str:
    """The general path (check, then coalesce) or its error message."""
    try:
        check_pairs(src, dst, pages, pages, "group 0")
    except ValueError as e:
        return str(e)
    return coalesce_array(src, dst)


def _id_cases() -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(7)
    cases: list[tuple[list[int], list[int]]] = [([], []), ([5], [9]), ([1, 2, 3], [7, 8, 9]), ([39], [39])]
    for n in (2, 5, 16, 17, 64, 300):
        start = int(rng.integers(1, 10))
        cases.append((list(range(start, start + n)), list(range(start + 3, start + 3 + n))))  # one run
        cases.append((list(range(start, start + n)), list(range(start + n, start, -1))))  # dst descending
        a = [int(x) for x in rng.choice(np.arange(1, 400), n, replace=False)]
        b = [int(x) for x in rng.choice(np.arange(1, 400), n, replace=False)]
        cases.append((a, b))  # fragmented
        cases.append((list(range(1, n + 1)), list(range(2, n + 2))))  # ends at the last page when n = 398
        cases.append((list(range(0, n)), list(range(1, n + 1))))  # null page
        cases.append((list(range(400 - n + 1, 401)), list(range(1, n + 1))))  # one past the end
        cases.append((a[:-1] + [a[0]], b))  # duplicate source
        cases.append((a, b[:-1] + [b[0]]))  # duplicate destination
        cases.append((a, b[:-1]))  # counts differ
    return cases


@pytest.mark.parametrize(("src", "dst"), _id_cases())
def test_group_runs_fast_paths_match_check_then_coalesce(src: list[int], dst: list[int]) -> None:
    want = _reference_runs(src, dst, 400)
    for s, d in ((src, dst), (np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))):
        if isinstance(want, str):
            with pytest.raises(ValueError) as info:
                group_runs(s, d, 400, 400, "group 0")
            assert str(info.value) == want
        else:
            got = group_runs(s, d, 400, 400, "group 0")
            assert got.dtype == np.int64 and got.reshape(-1, 3).tolist() == want.reshape(-1, 3).tolist()


@pytest.mark.parametrize("n", [1, 3, 40, 200])
def test_byte_descs_small_and_large_paths_address_every_page(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of building descriptors (plain Python for few, numpy for many) give the same rows, and those
    rows cover exactly the pages asked for, region by region."""
    rng = np.random.default_rng(n)
    p, d = layout(0x10000000, attn_pages=400, stride_pad=0), layout(0x70000000, attn_pages=450, slots=9)
    src = [int(x) for x in rng.choice(np.arange(1, 400), n, replace=False)]
    dst = [int(x) for x in rng.choice(np.arange(1, 450), n, replace=False)]
    plan = plan_pull(p, d, {0: (src, dst), 1: ([2, 3], [7, 8])})
    fast = {side: byte_descs(plan, side) for side in ("src", "dst")}
    monkeypatch.setattr(descriptors, "_FEW_DESCRIPTORS", -1 if plan.num_descriptors <= 64 else 10**9)
    other = {side: byte_descs(plan, side) for side in ("src", "dst")}
    for side, lay, ids, slots in (("src", p, src, [2, 3]), ("dst", d, dst, [7, 8])):
        assert fast[side].dtype == other[side].dtype == np.uint64
        assert fast[side].tolist() == other[side].tolist()
        want = sorted(
            (r.base_addr + i * r.page_stride, r.page_bytes)
            for r in lay.regions
            for i in (ids if r.group_id == 0 else slots)
        )
        got = []  # each descriptor cut back into pages (these layouts are contiguous: stride = page bytes)
        for addr, n_bytes, _ in fast[side].tolist():
            page = next(r.page_bytes for r in lay.regions if r.base_addr <= addr < r.base_addr + r.span_bytes)
            got += [(addr + k * page, page) for k in range(n_bytes // page)]
        assert sorted(got) == want
