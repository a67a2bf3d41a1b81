"""Zero freshly allocated attention KV blocks: every layer, K and V, in ONE kernel launch per step.

Why: a block handed out again still holds its previous owner's bytes. Attention kernels mask unused
positions by multiplying with zero, and 0 * NaN = NaN, so stale NaN/Inf bit patterns leak into other requests.
Fresh attention blocks that nothing overwrites completely are therefore zeroed before first use.

Ownership and threading:
- The model runner builds one `BlockZeroer` per attention group at start-up, right after it allocates that
  group's stacked KV tensor ([blocks, layers, ...]), and keeps it for the engine's life. The zeroer owns only
  its id buffers (a pinned host buffer and a device buffer, grown on demand); it never allocates or frees cache
  memory.
- Once per step, on the runner thread, before the step's forward, the runner calls `zero(ids)` with the block
  ids the scheduler drained from the attention manager that step (drained every step, DESIGN § Zeroing).
  The copy of the ids and the kernel are enqueued on the *current* CUDA stream, which must be the stream the
  forward runs on (always the same stream: the device id buffer is reused across calls). Not thread-safe.
- `zero` returns before the device has zeroed anything. Work on the same stream is ordered after it; anything
  that writes these blocks outside the stream (a NIXL READ into a partially transferred block) must wait for
  the stream first (e.g. an event recorded after `zero`), or the zeroing can land after the transfer.
- Ids <= 0 are ignored (block 0 is the null block; PAD_SLOT_ID = -1 marks padding): they are never touched.
  Ids >= num_blocks raise ValueError. A repeated id is zeroed (harmlessly) twice and counted twice.

Layout: each KV tensor is described as a *segment*: the address of page 0, the byte stride between pages, and the
bytes of one page. The engine's stacked layout [num_blocks, layers, 2, block_size, heads, head_dim] is one segment
per attention group (block b of every layer is one contiguous page); a per-layer tensor [num_blocks, 2,
block_size, heads, head_dim] is one segment per layer; another layout only needs its own segments.

    segment s:  base_s                                            (addresses in bytes)
                |<- page_stride_s ->|
                [ page 0 (null) ]...[ page 1 ]...[ page b                                      ]
                                                 |<-- CHUNK words -->|<-- CHUNK words -->|<-tail->|
    program (i, s, c) zeroes words [c*CHUNK, min((c+1)*CHUNK, page_words_s)) of page ids[i] in segment s:
        address = base_s + ids[i] * page_stride_s + c * CHUNK * word_bytes

Bytes are written as integer words (int64/int32/int16/int8, the widest the common alignment of every base,
stride and page size allows), so the cache dtype does not matter; with 16-byte alignment each thread issues
16-byte stores. The grid is (len(ids), num_segments, chunks_per_page): one launch covers every layer.

Backends: "triton" (the kernel; on CPU tensors only under TRITON_INTERPRET=1, for CI) and "torch" (CPU path:
one `index_fill_` per segment over an integer-word view of its pages). "auto" picks triton on CUDA, torch on CPU.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

try:  # Triton is a GPU-only dependency; the torch backend works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without Triton
    triton = None
    tl = None

DEFAULT_CHUNK_BYTES = 16 * 1024
"""Bytes one program zeroes (at most): enough stores in flight per thread to run at memset bandwidth."""
DEFAULT_NUM_WARPS = 4
_MAX_GRID_YZ = 65535
_TORCH_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class PageSegment:
    """One run of equally strided pages (one KV tensor: a stacked group or one layer). All numbers are in bytes."""

    base: int
    """Address of page 0."""
    page_stride: int
    """Distance between the starts of page b and page b + 1."""
    page_bytes: int
    """Bytes of one page; page_bytes <= page_stride (pages never overlap)."""


def block_major_segment(kv: torch.Tensor) -> PageSegment:
    """The segment of a tensor whose dim 0 is the block id and whose block slices are each contiguous."""
    if kv.dim() < 1 or kv.shape[0] < 1:
        raise ValueError(f"KV tensor needs a block dimension first, got shape {tuple(kv.shape)}")
    if not kv[0].is_contiguous():
        raise ValueError(f"one block of a KV tensor must be contiguous; got strides {kv.stride()}")
    elem = kv.element_size()
    page_bytes = kv[0].numel() * elem
    page_stride = kv.stride(0) * elem if kv.shape[0] > 1 else page_bytes
    if page_stride < page_bytes:
        raise ValueError(f"pages overlap: stride {page_stride} B < page {page_bytes} B")
    return PageSegment(base=kv.data_ptr(), page_stride=page_stride, page_bytes=page_bytes)


def _word_pages(kv: torch.Tensor, seg: PageSegment, num_blocks: int, word_bytes: int) -> torch.Tensor:
    """[num_blocks, page_words] integer view of a segment's pages (shares kv's storage; word_bytes divides the
    segment's base, stride and page size)."""
    storage = kv.untyped_storage()
    raw = torch.empty(0, dtype=_TORCH_WORDS[word_bytes], device=kv.device)
    raw.set_(storage, 0, (storage.nbytes() // word_bytes,), (1,))
    offset = (seg.base - storage.data_ptr()) // word_bytes
    return raw.as_strided((num_blocks, seg.page_bytes // word_bytes), (seg.page_stride // word_bytes, 1), offset)


def _alignment(segments: Sequence[PageSegment]) -> int:
    """Largest power of two (<= 16) dividing every base, stride and page size."""
    g = 0
    for s in segments:
        g = math.gcd(g, s.base, s.page_stride, s.page_bytes)
    return min(16, g & -g) if g else 16


def _zero_pages(ids_ptr, seg_ptr, WORD: tl.constexpr, ALIGN: tl.constexpr, VEC: tl.constexpr, CHUNK: tl.constexpr):
    # seg_ptr: int64 [num_segments, 3] = (base address in bytes, page stride in bytes, page size in words).
    blk = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    seg = tl.program_id(1)
    start = tl.program_id(2).to(tl.int64) * CHUNK
    base = tl.load(seg_ptr + seg * 3)
    stride = tl.load(seg_ptr + seg * 3 + 1)
    page_words = tl.load(seg_ptr + seg * 3 + 2)
    # int -> pointer drops what the compiler knows about alignment: restate it on the pointer (in bytes), or the
    # stores are not vectorized (checked in PTX: st.global.v2.b64 / v4.b32 only with this hint).
    page = tl.multiple_of((base + blk * stride).to(tl.pointer_type(WORD), bitcast=True), ALIGN)
    left = tl.multiple_of(page_words - start, VEC)
    offs = tl.arange(0, CHUNK)
    tl.store(page + start + offs, 0, mask=offs < left)


@functools.cache
def _kernel() -> Any:
    if triton is None:
        raise RuntimeError("the triton backend needs the `triton` package")
    return triton.jit(_zero_pages)


def _triton_word(word_bytes: int) -> Any:
    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[word_bytes]


def _interpreting() -> bool:
    """Whether triton.jit builds interpreted kernels (Triton reads TRITON_INTERPRET when it decorates)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


class BlockZeroer:
    """Zeroes given blocks in every layer of one attention group; see the module docstring for ownership."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        backend: str = "auto",
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
    ) -> None:
        if not kv_caches:
            raise ValueError("BlockZeroer needs at least one KV tensor")
        self.device = kv_caches[0].device
        self.num_blocks = int(kv_caches[0].shape[0])
        for kv in kv_caches:
            if kv.device != self.device or kv.shape[0] != self.num_blocks:
                raise ValueError("all KV tensors must share one device and num_blocks")
        self.backend = self._pick_backend(backend)
        self.segments = [block_major_segment(kv) for kv in kv_caches]
        self.launches = 0
        """Kernel launches issued (triton backend): one per zero() call with at least one valid id."""

        align = _alignment(self.segments)
        self._word_bytes = min(align, 8)
        self._align, self._vec = align, align // self._word_bytes
        max_words = max(s.page_bytes for s in self.segments) // self._word_bytes
        chunk = min(max(chunk_bytes // self._word_bytes, 1), max_words)
        self._chunk = max(1 << (chunk - 1).bit_length(), self._vec, 16)  # a power of two (tl.arange)
        self._chunks_per_page = -(-max_words // self._chunk)
        self._num_warps = num_warps
        if len(self.segments) > _MAX_GRID_YZ or self._chunks_per_page > _MAX_GRID_YZ:
            raise ValueError("too many segments or chunks per page for one launch; raise chunk_bytes")

        if self.backend == "torch":
            self._pages = [
                _word_pages(kv, s, self.num_blocks, self._word_bytes)
                for kv, s in zip(kv_caches, self.segments, strict=True)
            ]
        else:
            table = [(s.base, s.page_stride, s.page_bytes // self._word_bytes) for s in self.segments]
            self._seg_table = torch.tensor(table, dtype=torch.int64, device=self.device)
        self._pinned = self.device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=self.device)
        self._copy_done = torch.cuda.Event() if self._pinned else None

    def _pick_backend(self, backend: str) -> str:
        if backend == "auto":
            return "triton" if self.device.type == "cuda" else "torch"
        if backend not in ("triton", "torch"):
            raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")
        if backend == "triton":
            if self.device.type == "cpu" and not _interpreting():
                raise ValueError("the triton backend on CPU tensors needs TRITON_INTERPRET=1 set before import")
            if self.device.type not in ("cpu", "cuda"):
                raise ValueError(f"the triton backend supports cuda (or interpreted cpu), not {self.device}")
        return backend

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id zeroes across all segments."""
        return sum(s.page_bytes for s in self.segments)

    def zero(self, block_ids: Sequence[int]) -> int:
        """Zero `block_ids` in every segment (asynchronously on CUDA). Returns how many ids were zeroed
        (ids <= 0 ignored, repeats counted). Raises ValueError for an id >= num_blocks."""
        if len(block_ids) == 0:
            return 0
        ids = self._stage(block_ids)
        if ids.size == 0:
            return 0
        if self.backend == "torch":
            index = torch.from_numpy(ids.astype(np.int64)).to(self.device)
            for pages in self._pages:
                pages.index_fill_(0, index, 0)
        else:
            self._launch(ids.size)
        return int(ids.size)

    def _stage(self, block_ids: Sequence[int]) -> np.ndarray:
        """Write valid ids into the (pinned) host buffer; returns the numpy view of them."""
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous call's H2D copy may still read the host buffer
        n = len(block_ids)
        if n > self._host.numel():
            self._grow(n)
        view = self._host.numpy()
        view[:n] = block_ids
        ids = view[:n]
        if ids.max() >= self.num_blocks:
            raise ValueError(f"block id {int(ids.max())} out of range (num_blocks={self.num_blocks})")
        if ids.min() <= 0:
            kept = ids[ids > 0].copy()
            view[: kept.size] = kept
            ids = view[: kept.size]
        return ids

    def _grow(self, n: int) -> None:
        cap = 1 << max(n - 1, 63).bit_length()
        self._host = torch.empty(cap, dtype=torch.int32, pin_memory=self._pinned)
        self._dev = torch.empty(cap, dtype=torch.int32, device=self.device)

    def _launch(self, n: int) -> None:
        if self._copy_done is not None:
            with torch.cuda.device(self.device):
                self._dev[:n].copy_(self._host[:n], non_blocking=True)
                self._copy_done.record()
                self._run_kernel(n)
        else:
            self._dev[:n].copy_(self._host[:n])
            self._run_kernel(n)
        self.launches += 1

    def _run_kernel(self, n: int) -> None:
        grid = (n, len(self.segments), self._chunks_per_page)
        _kernel()[grid](
            self._dev,
            self._seg_table,
            WORD=_triton_word(self._word_bytes),
            ALIGN=self._align,
            VEC=self._vec,
            CHUNK=self._chunk,
            num_warps=self._num_warps,
        )
