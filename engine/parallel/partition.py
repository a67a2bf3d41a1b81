"""Which heads, groups and channels each tensor-parallel rank holds: pure index arithmetic (no torch), shared by
the model sharding (engine.parallel.shard) and the handoff planner between workers of different TP sizes
(kvtransfer.tp_slices), so the two can never disagree.

    heads          rank r of tp holds heads [r*H/tp, (r+1)*H/tp)
    MLP widths     a contiguous share, as even as the width allows in whole runs of WIDTH_GRANULE channels when the
                   width is made of them (a grouped GEMM's bf16 operands need strides of 16 bytes), else of single
                   channels (the first ranks then hold one more); only the output, summed over ranks, is seen outside
    groups         (KV heads, Mamba B/C groups, GDN key heads): a slice when tp divides G, else the one group its
                   heads use, replicated on tp/G ranks
    Mamba conv     | x: H*P | B: G*N | C: G*N |  -> x channels of its heads, B and C channels of its groups
    GDN conv       | q: Kh*dk | k: Kh*dk | v: Hv*dv |  -> q and k of its key heads, v of its value heads
"""

from __future__ import annotations


def split_range(total: int, world: int, rank: int) -> range:
    """Rank's contiguous share of `total` items split evenly (total must divide by world)."""
    if total % world:
        raise ValueError(f"{total} cannot be split evenly over {world} ranks")
    n = total // world
    return range(rank * n, (rank + 1) * n)


def balanced_range(total: int, world: int, rank: int) -> range:
    """Rank's contiguous share of `total` items split as evenly as they allow: the first total % world ranks hold
    one more (total >= world, so every rank holds at least one)."""
    if total < world:
        raise ValueError(f"{total} cannot be split over {world} ranks (fewer than one each)")
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


WIDTH_GRANULE = 8
"""Channels per run of an MLP width split (8 bf16 values: 16 bytes, the stride torch._grouped_mm requires)."""


def width_share(total: int, world: int, rank: int) -> range:
    """Rank's channels of an MLP or expert width of `total`: equal shares when they are whole granules, else
    whole granules as evenly as they go (48 over 4: 16, 16, 8, 8), else single channels (45 over 2: 23, 22)."""
    if total % WIDTH_GRANULE == 0 and total // WIDTH_GRANULE >= world:
        runs = balanced_range(total // WIDTH_GRANULE, world, rank)
        return range(runs.start * WIDTH_GRANULE, runs.stop * WIDTH_GRANULE)
    return balanced_range(total, world, rank)


def group_share(num_groups: int, world: int, rank: int) -> range:
    """Which of `num_groups` head groups rank holds when the heads they serve are split evenly over `world` ranks:
    a slice of groups when world divides num_groups, else the one group all of the rank's heads use (replicated on
    world / num_groups ranks; num_groups must divide world)."""
    if num_groups % world == 0:
        return split_range(num_groups, world, rank)
    if world % num_groups:
        raise ValueError(f"{num_groups} groups cannot be split or replicated over {world} ranks")
    g = rank * num_groups // world
    return range(g, g + 1)


def blocks(items: range, width: int, offset: int = 0) -> list[range]:
    """Channel ranges [offset + i*width, offset + (i+1)*width) of items i (heads or groups)."""
    return [range(offset + i * width, offset + (i + 1) * width) for i in items]


def flat(ranges: list[range]) -> list[int]:
    return [i for r in ranges for i in r]


def mamba_conv_channels(
    num_heads: int, head_dim: int, n_groups: int, state_size: int, heads: range, groups: range
) -> list[range]:
    """The conv channels (of conv_dim = | x | B | C |) a rank with these heads and groups holds, in order."""
    inter, gn = num_heads * head_dim, n_groups * state_size
    return blocks(heads, head_dim) + blocks(groups, state_size, inter) + blocks(groups, state_size, inter + gn)


def gdn_conv_channels(
    num_k_heads: int, head_k_dim: int, head_v_dim: int, k_heads: range, v_heads: range
) -> list[range]:
    """The conv channels (of conv_dim = | q | k | v |) a rank with these key and value heads holds, in order."""
    key_dim = num_k_heads * head_k_dim
    return blocks(k_heads, head_k_dim) + blocks(k_heads, head_k_dim, key_dim) + blocks(v_heads, head_v_dim, 2 * key_dim)


__all__ = [
    "WIDTH_GRANULE",
    "balanced_range",
    "blocks",
    "flat",
    "gdn_conv_channels",
    "group_share",
    "mamba_conv_channels",
    "split_range",
    "width_share",
]
