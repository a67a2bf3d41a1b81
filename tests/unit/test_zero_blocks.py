"""BlockZeroer zeroes exactly the listed blocks, in every layer, and leaves every other byte as it was.

Three backends run the same scenarios:
- the torch (CPU) path, in this process;
- the Triton kernel under TRITON_INTERPRET=1, in a child pytest: Triton decides interpreted vs compiled when a
  function is decorated with @triton.jit, and its own standard library is decorated when triton is imported, so
  the variable must be set before the import (a fresh process is the only reliable way);
- the compiled Triton kernel on CUDA (`gpu` marker; skipped without a device).

Every scenario fills the caches with random non-zero data plus NaN and Inf, snapshots the whole allocation
(gaps between pages included), zeroes a list of ids (unsorted, non-contiguous, repeated, with the ignored null
block 0 and PAD_SLOT_ID -1), and compares every byte against the snapshot with the listed pages zeroed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hybridpd.engine.kernels.zero_blocks import BlockZeroer, block_major_segment

NUM_BLOCKS = 40
CALLS: list[list[int]] = [
    [7, 3, 39, 3, 12, 13, 1, 0, -1, 25],  # unsorted, gaps, a repeat, both ends, ignored 0 / -1
    [2],
    [0, -1],  # nothing valid: no launch
    [i % 37 + 2 for i in range(0, 300, 3)],  # longer than the initial id buffers (they grow)
]
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]

Layout = Callable[[torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""Returns (owners: the allocations, kvs: the per-layer KV tensors, views into owners)."""


def _plain(dtype: torch.dtype, layers: int, shape: tuple[int, ...]) -> Layout:
    def make(device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        owners = [torch.empty((NUM_BLOCKS, *shape), dtype=dtype, device=device) for _ in range(layers)]
        return owners, owners

    return make


def _strided(device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pages inside a larger allocation: a 64-byte gap after every page that must stay untouched."""
    page = 2 * 16 * 3 * 24
    owners = [torch.empty((NUM_BLOCKS, page + 32), dtype=torch.bfloat16, device=device) for _ in range(2)]
    return owners, [o[:, :page].view(NUM_BLOCKS, 2, 16, 3, 24) for o in owners]


def _mixed(device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layers of different page sizes and dtypes in one zeroer (chunks past a small page do nothing)."""
    owners = [
        torch.empty((NUM_BLOCKS, 2, 16, 3, 24), dtype=torch.bfloat16, device=device),
        torch.empty((NUM_BLOCKS, 2, 16, 1, 8), dtype=torch.bfloat16, device=device),
        torch.empty((NUM_BLOCKS, 2, 16, 2, 8), dtype=torch.float32, device=device),
    ]
    return owners, owners


LAYOUTS: dict[str, Layout] = {
    "bf16_odd_page": _plain(torch.bfloat16, 3, (2, 16, 3, 24)),  # 4608 B pages, 16 B aligned
    "fp32_odd_page": _plain(torch.float32, 2, (2, 16, 3, 24)),
    "fp32_8byte_aligned": _plain(torch.float32, 2, (2, 1, 1, 3)),  # 24 B pages: int64 words
    "fp16_2byte_aligned": _plain(torch.float16, 2, (1, 1, 1, 1)),  # 2 B pages: int16 words
    "uint8_unaligned": _plain(torch.uint8, 2, (1, 1, 1, 3)),  # 3 B pages: int8 words
    "strided_pages": _strided,
    "mixed_pages": _mixed,
}
CHUNKS = [None, 1024]  # default (one chunk covers a test page) and 1 KiB (several chunks, a partial tail)
CASES = [pytest.param(layout, chunk, id=f"{layout}-chunk{chunk}") for layout in LAYOUTS for chunk in CHUNKS]


def _fill(owners: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for o in owners:
        if o.dtype.is_floating_point:
            x = torch.randn(o.shape, generator=gen, dtype=torch.float32)
            x[x == 0] = 1.0
            flat = x.view(-1)
            flat[::7] = float("nan")
            flat[3::11] = float("inf")
        else:
            x = torch.randint(1, 255, o.shape, generator=gen)
        o.copy_(x.to(o.dtype))


def _expected(owners: list[torch.Tensor], kvs: list[torch.Tensor], snapshot: list[torch.Tensor], ids: list[int]):
    """The snapshot with every listed page of every layer zeroed (plain indexing on the same views)."""
    expected = [s.clone() for s in snapshot]
    by_storage = {o.untyped_storage().data_ptr(): e for o, e in zip(owners, expected, strict=True)}
    valid = [i for i in ids if i > 0]
    for kv in kvs:
        e = by_storage[kv.untyped_storage().data_ptr()]
        view = torch.as_strided(e, kv.size(), kv.stride(), kv.storage_offset())
        if valid:
            view[torch.tensor(valid, device=kv.device)] = 0
    return expected


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def run_scenario(layout: str, chunk: int | None, backend: str, device: torch.device) -> None:
    owners, kvs = LAYOUTS[layout](device)
    kwargs = {} if chunk is None else {"chunk_bytes": chunk}
    zeroer = BlockZeroer(kvs, backend=backend, **kwargs)
    for call, ids in enumerate(CALLS):
        _fill(owners, seed=call)
        snapshot = [o.clone() for o in owners]
        launches = zeroer.launches
        n = zeroer.zero(ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert n == sum(1 for i in ids if i > 0)
        if backend == "triton":
            assert zeroer.launches - launches == (1 if n else 0), "one launch per call"
        valid = sorted({i for i in ids if i > 0})
        for kv in kvs:  # the listed blocks are all zero ...
            assert not (valid and _bytes(kv[valid]).any()), f"call {call}: a listed block is not zero"
        for o, e in zip(owners, _expected(owners, kvs, snapshot, ids), strict=True):  # ... and nothing else moved
            same = _bytes(o) == _bytes(e)
            assert bool(same.all()), f"call {call}: {int((~same).sum())} bytes differ from the expected cache"


@pytest.mark.parametrize(("layout", "chunk"), CASES)
def test_torch_path_zeroes_exactly_the_listed_blocks(layout: str, chunk: int | None) -> None:
    run_scenario(layout, chunk, "torch", torch.device("cpu"))


@pytest.mark.skipif(not INTERPRETING, reason="runs in a child process with TRITON_INTERPRET=1")
@pytest.mark.parametrize(("layout", "chunk"), CASES)
def test_triton_interpreted(layout: str, chunk: int | None) -> None:
    pytest.importorskip("triton")
    run_scenario(layout, chunk, "triton", torch.device("cpu"))


@pytest.mark.skipif(INTERPRETING, reason="already interpreting: test_triton_interpreted runs directly")
def test_triton_kernel_under_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_triton_interpreted"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"{len(CASES)} passed" in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("layout", "chunk"), CASES)
def test_triton_compiled_on_cuda(layout: str, chunk: int | None) -> None:
    run_scenario(layout, chunk, "auto", torch.device("cuda"))  # auto = the compiled Triton kernel on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_path_on_cuda() -> None:
    run_scenario("mixed_pages", None, "torch", torch.device("cuda"))


def test_out_of_range_id_raises_and_touches_nothing() -> None:
    owners, kvs = LAYOUTS["bf16_odd_page"](torch.device("cpu"))
    _fill(owners, seed=0)
    snapshot = [o.clone() for o in owners]
    zeroer = BlockZeroer(kvs)
    with pytest.raises(ValueError, match="out of range"):
        zeroer.zero([3, NUM_BLOCKS])
    assert all(_bytes(o).equal(_bytes(s)) for o, s in zip(owners, snapshot, strict=True))
    assert zeroer.zero([]) == 0


def test_construction_checks() -> None:
    kv = torch.zeros(NUM_BLOCKS, 2, 16, 3, 24)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockZeroer([kv, torch.zeros(NUM_BLOCKS + 1, 2, 16, 3, 24)])
    with pytest.raises(ValueError, match="contiguous"):
        BlockZeroer([kv.transpose(1, 2)])
    with pytest.raises(ValueError, match="backend"):
        BlockZeroer([kv], backend="cuda")
    if not INTERPRETING:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            BlockZeroer([kv], backend="triton")


def test_segment_of_block_major_layout() -> None:
    kv = torch.zeros(NUM_BLOCKS, 2, 16, 3, 24, dtype=torch.bfloat16)
    seg = block_major_segment(kv)
    assert (seg.base, seg.page_stride, seg.page_bytes) == (kv.data_ptr(), 4608, 4608)
    assert BlockZeroer([kv, kv.clone()]).bytes_per_block == 2 * 4608
