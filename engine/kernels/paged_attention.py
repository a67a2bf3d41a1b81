"""Paged attention for a flat varlen batch (prefill chunks with prefix hits and decodes in one launch), and the
K/V write into the paged cache. Triton; runs under TRITON_INTERPRET=1 on CPU for tests.

One program per (sequence, query tile, KV head). Its rows are (query token, query head of the KV head's group):

    rows r = i * G + g   (i: query token of the tile, g: head in the GQA group, G = heads // kv_heads)
    query token i of the sequence sits at context position ctx_len - q_len + i and sees positions <= that one
    context position p lives at block_table[seq, p // block_size], offset p % block_size

Keys are visited in tiles of BLOCK_N positions with an online softmax in fp32; probabilities are rounded to the
value dtype before the P @ V product (as the reference rounds its probabilities to the query dtype). fp32 inputs use
IEEE fp32 dot products (no TF32). Sequences with ctx_len 0 (padded rows) output zeros and read nothing.
Any head dim and GQA group size: a head dim that is not a power of two is padded to one (the extra columns load as
zeros and are never stored), a group of G heads takes G rounded up to a power of two rows per token (the extra rows
are masked), e.g. Nemotron-Nano-9B-v2's 40 heads on 8 KV heads (G 5) or Qwen3.5-27B's 24 on 4 (G 6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_vt, stride_blk, stride_kv, stride_tok,
                     BLOCK_SIZE: tl.constexpr, WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        cols = tl.arange(0, WIDTH_P2)
        m = cols < WIDTH
        dst = cache_ptr + blk * stride_blk + off * stride_tok + cols
        tl.store(dst, tl.load(k_ptr + t * stride_kt + cols, mask=m).to(cache_ptr.dtype.element_ty), mask=m)
        tl.store(dst + stride_kv, tl.load(v_ptr + t * stride_vt + cols, mask=m).to(cache_ptr.dtype.element_ty),
                 mask=m)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] -> kv_cache [blocks, 2, block_size, KVH, D] at slot_mapping (PAD_SLOT_ID rows skipped)."""
    T = k.shape[0]
    if T == 0:
        return
    assert kv_cache.stride(3) == kv_cache.shape[4] and kv_cache.stride(4) == 1, "KVH x D must be contiguous"
    k2, v2 = k.reshape(T, -1), v.reshape(T, -1)
    width = k2.shape[1]
    _write_kv_kernel[(T,)](k2, v2, kv_cache, slot_mapping, k2.stride(0), v2.stride(0), kv_cache.stride(0),
                           kv_cache.stride(1), kv_cache.stride(2), BLOCK_SIZE=kv_cache.shape[2], WIDTH=width,
                           WIDTH_P2=triton.next_power_of_2(width))


@triton.jit
def _load_tile(ptrs, rows_ok, d_ok, MASKED: tl.constexpr, PAD_D: tl.constexpr):
    """A [rows, head dim] tile; masked rows (MASKED) and padded head-dim columns (PAD_D) read as zeros."""
    if MASKED:
        if PAD_D:
            t = tl.load(ptrs, mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            t = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        if PAD_D:
            t = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
        else:
            t = tl.load(ptrs)
    return t


@triton.jit
def _attend(q, acc, m_i, l_i, n0, s, h, kv_end, q_pos, d, cache_ptr, table_ptr, scale, stride_blk, stride_kv,
            stride_tok, stride_kvh, stride_table, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            IEEE: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax. MASKED = False: every key of the tile is below
    kv_end and visible to every row (the tiles left of the causal diagonal): no masks computed."""
    p = n0 + tl.arange(0, BLOCK_N)
    p_ok = p < kv_end
    d_ok = d < HEAD_DIM
    if MASKED:
        blk = tl.load(table_ptr + s * stride_table + p // BLOCK_SIZE, mask=p_ok, other=0)
    else:
        blk = tl.load(table_ptr + s * stride_table + p // BLOCK_SIZE)
    base = blk.to(tl.int64) * stride_blk + (p % BLOCK_SIZE) * stride_tok + h * stride_kvh
    k = _load_tile(cache_ptr + base[:, None] + d[None, :], p_ok, d_ok, MASKED, PAD_D).to(q.dtype)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * (scale * 1.4426950408889634)  # log2(e): exp2 below
    if MASKED:
        visible = (p[None, :] <= q_pos[:, None]) & p_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    prob = tl.math.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(prob, 1)
    v = _load_tile(cache_ptr + base[:, None] + stride_kv + d[None, :], p_ok, d_ok, MASKED, PAD_D).to(q.dtype)
    if IEEE:
        pv = tl.dot(prob.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(prob.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _attention_kernel(q_ptr, cache_ptr, out_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, table_ptr, scale,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_blk, stride_kv, stride_tok, stride_kvh,
                      stride_table, BLOCK_SIZE: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    s = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + s)
    ctx_len = tl.load(ctx_len_ptr + s)
    if tile * BLOCK_M >= q_len:
        return
    q0 = tl.load(q_start_ptr + s)
    R: tl.constexpr = BLOCK_M * G_P2
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_P2
    r = tl.arange(0, R)
    i = tile * BLOCK_M + r // G_P2
    g = r % G_P2
    head = h * G + tl.where(g < G, g, 0)
    row_ok = (i < q_len) & (g < G)
    d = tl.arange(0, HEAD_DIM_P2)
    io_ok = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_off = (q0 + i)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    out_off = (q0 + i)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if ctx_len == 0:
        tl.store(out_ptr + out_off, tl.zeros([R, HEAD_DIM_P2], tl.float32).to(out_ptr.dtype.element_ty), mask=io_ok)
        return
    q = tl.load(q_ptr + q_off, mask=io_ok, other=0.0)
    q_pos = ctx_len - q_len + i  # context position of each row's query token
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_M)
    # keys below the tile's first query position are visible to all its rows: whole tiles of them go unmasked
    full_end = tl.minimum(ctx_len - q_len + tile * BLOCK_M + 1, kv_end) // BLOCK_N * BLOCK_N
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, HEAD_DIM_P2], tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, n0, s, h, kv_end, q_pos, d, cache_ptr, table_ptr, scale,
                                stride_blk, stride_kv, stride_tok, stride_kvh, stride_table, BLOCK_SIZE, BLOCK_N,
                                IEEE, False, HEAD_DIM, PAD_D)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, n0, s, h, kv_end, q_pos, d, cache_ptr, table_ptr, scale,
                                stride_blk, stride_kv, stride_tok, stride_kvh, stride_table, BLOCK_SIZE, BLOCK_N,
                                IEEE, True, HEAD_DIM, PAD_D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=io_ok)


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, m_ptr, l_ptr, o_ptr, q_start_ptr, ctx_len_ptr, table_ptr, scale,
                         stride_qt, stride_qh, stride_blk, stride_kv, stride_tok, stride_kvh, stride_table,
                         H: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, G: tl.constexpr,
                         R: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    """Decode (one query token per sequence), keys cut into SPLITS ranges: program (s, split, h) runs the online
    softmax of the G query heads of KV head h over its range and stores the unnormalised accumulator with its
    running max (log2 domain) and sum; _decode_reduce_kernel merges the ranges."""
    s = tl.program_id(0)
    split = tl.program_id(1)
    h = tl.program_id(2)
    ctx_len = tl.load(ctx_len_ptr + s)
    r = tl.arange(0, R)
    row_ok = r < G
    head = h * G + tl.where(row_ok, r, 0)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_P2
    d = tl.arange(0, HEAD_DIM_P2)
    io_ok = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q0 = tl.load(q_start_ptr + s)
    q = tl.load(q_ptr + q0 * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_ok, other=0.0)
    chunk = tl.cdiv(tl.cdiv(ctx_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx_len, lo + chunk)
    q_pos = tl.zeros([R], tl.int32) + ctx_len - 1
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, HEAD_DIM_P2], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, n0, s, h, hi, q_pos, d, cache_ptr, table_ptr, scale,
                                stride_blk, stride_kv, stride_tok, stride_kvh, stride_table, BLOCK_SIZE, BLOCK_N,
                                IEEE, True, HEAD_DIM, PAD_D)
    part = (s * SPLITS + split) * H + head
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=io_ok)


@triton.jit
def _decode_reduce_kernel(m_ptr, l_ptr, o_ptr, out_ptr, q_start_ptr, stride_ot, stride_oh, H: tl.constexpr,
                          SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HEAD_DIM_P2: tl.constexpr):
    s = tl.program_id(0)
    head = tl.program_id(1)
    k = tl.arange(0, SPLITS_P2)
    k_ok = k < SPLITS
    part = (s * SPLITS + k) * H + head
    m = tl.load(m_ptr + part, mask=k_ok, other=float("-inf"))
    lsum = tl.load(l_ptr + part, mask=k_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    total = tl.sum(w * lsum, 0)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    o = tl.load(o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    q0 = tl.load(q_start_ptr + s)
    tl.store(out_ptr + q0 * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


_SMS: dict[int, int] = {}


def decode_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """Key ranges per (sequence, KV head) of a decode step: enough programs for about 8 per multiprocessor (a
    batch-1 decode at 8k context otherwise ran on 4 of 132), at most 16. Depends on the batch only, so a CUDA graph
    captured for a batch size stays valid for every context length."""
    if device.type != "cuda":
        return 3  # Triton's interpreter (tests): ranges to merge, some of them empty
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return max(1, min(16, 8 * _SMS[idx] // max(1, num_seqs * kv_heads)))


def decode_tile(head_dim: int) -> tuple[int, int, int]:
    """(keys per tile, warps, pipeline stages) of the split-KV decode kernel. benchmarks/decode_kernels.py
    --attention-tiles (H200, batch 64, one launch per timing, so +-15 %): 64 keys and 4 warps were the fastest or
    within noise of it at 1k and 8k context, head dims 128 and 256; 32 keys (the prefill kernel's choice for 256)
    was 5-20 % slower at head dim 256."""
    return 64, 4, (3 if head_dim <= 128 else 2)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, q_start: torch.Tensor,
                     ctx_len: torch.Tensor, block_table: torch.Tensor, scale: float, splits: int,
                     tile: tuple[int, int, int] | None = None) -> None:
    """One query token per sequence (q_len 1 for every sequence): split-KV attention, then the merge. `tile`:
    (keys per tile, warps, pipeline stages), DECODE_TILE's by default."""
    S, (H, D), kvh = q_start.shape[0], q.shape[1:], kv_cache.shape[3]
    G = H // kvh
    block_n, warps, stages = tile or decode_tile(D)
    m = torch.empty(S, splits, H, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    o = torch.empty(S, splits, H, D, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(S, splits, kvh)](
        q, kv_cache, m, lsum, o, q_start, ctx_len, block_table, scale, q.stride(0), q.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0), H=H, SPLITS=splits,
        BLOCK_SIZE=kv_cache.shape[2], G=G, R=max(16, triton.next_power_of_2(G)), HEAD_DIM=D,
        HEAD_DIM_P2=triton.next_power_of_2(D), BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=warps,
        num_stages=stages)
    _decode_reduce_kernel[(S, H)](m, lsum, o, out, q_start, out.stride(0), out.stride(1), H=H, SPLITS=splits,
                                  SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=D,
                                  HEAD_DIM_P2=triton.next_power_of_2(D))


def paged_attention_varlen(q: torch.Tensor, kv_cache: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                           ctx_len: torch.Tensor, block_table: torch.Tensor, max_q_len: int, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]; kv_cache [blocks, 2, block_size, KVH, D] (a layer's slice of the stacked cache, K/V of this
    step already written); per sequence s: q_start/q_len/ctx_len int32 [S], block_table int32 [S, W].
    Returns out [T, H, D] in q's dtype (rows of no sequence are left as they are in `out`, zeros if allocated)."""
    T, H, D = q.shape
    kvh = kv_cache.shape[3]
    G = H // kvh
    assert G * kvh == H, "query heads must be a multiple of the KV heads"
    assert kv_cache.stride(4) == 1 and q.stride(2) == 1
    if out is None:
        out = torch.zeros_like(q)
    S = q_start.shape[0]
    if S == 0 or T == 0:
        return out
    if max_q_len == 1:
        decode_attention(q, kv_cache, out, q_start, ctx_len, block_table, scale, decode_splits(S, kvh, q.device))
        return out
    launch_attention(q, kv_cache, out, q_start, q_len, ctx_len, block_table, max_q_len, scale,
                     attention_config(max_q_len, triton.next_power_of_2(D), q.dtype))
    return out


def attention_config(max_q_len: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(rows per program, keys per tile, warps, pipeline stages). Rows are query tokens x heads of a group: 16 for
    decode; 128 for long bf16 prefills with head dim <= 128 (half the K/V re-reads of 64), else 64.
    benchmarks/prefill_kernels.py compares the choices (H200, 8,192 tokens, causal): 128 rows x 64 keys with 4
    warps took 1.29 ms per Nemotron-3-Nano layer and 1.64 per Nemotron-H-8B layer, against 1.78 / 1.72 with 8
    warps (torch's flash attention: 0.93 / 1.01, on contiguous K/V)."""
    long_prefill = max_q_len >= 128 and head_dim <= 128 and dtype != torch.float32
    rows = 16 if max_q_len == 1 else 128 if long_prefill else 64
    block_n = 64 if head_dim <= 128 else 32
    warps = 8 if head_dim > 128 else 4
    return rows, block_n, warps, 3


def launch_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, q_start: torch.Tensor,
                     q_len: torch.Tensor, ctx_len: torch.Tensor, block_table: torch.Tensor, max_q_len: int,
                     scale: float, config: tuple[int, int, int, int]) -> None:
    rows, block_n, warps, stages = config
    H, D = q.shape[1], q.shape[2]
    kvh = kv_cache.shape[3]
    G = H // kvh
    G_P2 = triton.next_power_of_2(G)
    block_m = max(1, rows // G_P2)
    grid = (q_start.shape[0], triton.cdiv(max_q_len, block_m), kvh)
    _attention_kernel[grid](
        q, kv_cache, out, q_start, q_len, ctx_len, block_table, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        BLOCK_SIZE=kv_cache.shape[2], G=G, G_P2=G_P2, HEAD_DIM=D, HEAD_DIM_P2=triton.next_power_of_2(D),
        BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )


__all__ = ["attention_config", "decode_attention", "decode_splits", "launch_attention", "paged_attention_varlen",
           "write_kv"]
