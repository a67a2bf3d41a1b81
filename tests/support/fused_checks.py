"""Checks of the fast path's fused kernels (engine.kernels.fused, recurrent_step) against the reference modules
they replace; run on CPU under TRITON_INTERPRET=1 by tests/unit/test_fused_kernels.py and on CUDA by
tests/gpu/test_fused_kernels_cuda.py. fp32: equal to float rounding. bf16: the kernels round where the reference
holds a value in bf16, so on the GPU nearly every element is bit-identical (`strict`); Triton's interpreter
truncates when it converts to bf16 (measured: half the elements one step low), so on CPU bf16 results are only
required to be within a few bf16 steps."""

from __future__ import annotations

import torch
from hybridpd.engine.kernels.fused import gated_group_norm, gated_head_norm, moe_combine, relu2, rms_norm, silu_mul
from hybridpd.engine.kernels.recurrent_prefill import mamba_chunk_inputs, mamba_skip_add
from hybridpd.engine.models.gated_deltanet import GatedRMSNorm
from hybridpd.engine.models.layers import RMSNorm, ZeroCenteredRMSNorm
from hybridpd.engine.models.layers import relu2 as relu2_reference
from hybridpd.engine.models.mamba2 import GroupGatedRMSNorm

GEN = torch.Generator().manual_seed(0)
DEVICE = "cpu"
STRICT = False


def setup(device: str, strict: bool) -> None:
    global DEVICE, STRICT
    DEVICE, STRICT = device, strict


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype).to(DEVICE)


def idx(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def check(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        return
    g, w = got.float(), want.float()
    same = (g == w).float().mean().item()
    assert not STRICT or same >= 0.99, f"only {same:.4f} of the elements are bit-identical"
    steps = 1 if STRICT else 4  # the interpreter's truncations compound over a kernel's rounding points
    bound = w.abs() * steps * 2**-7 + atol
    assert ((g - w).abs() <= bound).all(), f"an element is off by more than {steps} bf16 steps"


def check_rms_norm_with_and_without_residual(dtype: torch.dtype, zero_centered: bool) -> None:
    D = 96
    norm = (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(D, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(rand(D, scale=0.3).cpu() + (0 if zero_centered else 1))
    norm = norm.to(dtype).to(DEVICE)
    x, res = rand(7, D, dtype=dtype, scale=2.0), rand(7, D, dtype=dtype)
    out, h = rms_norm(x, norm.weight, norm.eps, zero_centered)
    assert h is x
    check(out, norm(x))
    out, h = rms_norm(x, norm.weight, norm.eps, zero_centered, residual=res)
    check(h, res + x)  # the residual stream, rounded as the reference's `h + x`
    check(out, norm(res + x))


def check_rms_norm_per_head_of_a_strided_view() -> None:
    """q of Qwen3.5's attention: [n, heads, 2 * hd] chunked to [n, heads, hd] (rows strided), per-head norm."""
    norm = ZeroCenteredRMSNorm(16, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(rand(16, scale=0.2))
    q, _gate = rand(5, 3, 32).chunk(2, dim=-1)
    out, _ = rms_norm(q, norm.weight, norm.eps, True)
    check(out, norm(q))


def check_gated_group_norm(dtype: torch.dtype) -> None:
    C, gs = 64, 16
    ref = GroupGatedRMSNorm(C, gs, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(1 + rand(C, scale=0.2).cpu())
    ref = ref.to(dtype).to(DEVICE)
    y = rand(6, C, scale=3.0)
    proj = rand(6, 2 * C, dtype=dtype)
    gate = proj[:, :C]  # a strided slice, as in_proj's
    check(gated_group_norm(y, gate, ref.weight, gs, ref.eps, dtype), ref(y, gate).to(dtype))


def check_gated_head_norm(dtype: torch.dtype) -> None:
    H, V = 3, 32
    ref = GatedRMSNorm(V, 1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + rand(V, scale=0.2).cpu())
    ref = ref.to(dtype).to(DEVICE)
    core = rand(5, H, V, scale=2.0)
    z = rand(5, 2 * H * V, dtype=dtype)[:, H * V:].view(5, H, V)
    want = ref(core.to(dtype), z).reshape(5, H * V)
    check(gated_head_norm(core, z, ref.weight, ref.eps, dtype), want)


def check_silu_mul(dtype: torch.dtype) -> None:
    gu = rand(4, 2 * 50, dtype=dtype, scale=3.0)
    g, u = gu[:, :50], gu[:, 50:]
    check(silu_mul(gu), torch.nn.functional.silu(g) * u)


def check_relu2(dtype: torch.dtype) -> None:
    x = rand(5, 3001, dtype=dtype, scale=3.0)  # not a multiple of the block: the tail is masked
    check(relu2(x), relu2_reference(x))


def check_moe_combine(dtype: torch.dtype) -> None:
    """The routed experts' outputs (sorted by expert) back on their tokens, against the reference's index_add_ of
    each expert's fp32 products (nemotron_h.NemotronHMoE.forward), rounded once to the dtype."""
    T, top, H, E = 37, 3, 1100, 8
    idx_ = torch.stack([torch.randperm(E, generator=GEN)[:top] for _ in range(T)]).to(DEVICE)
    w = rand(T, top).abs().to(DEVICE)
    order = torch.argsort(idx_.reshape(-1), stable=True)
    rows = rand(T * top, H, dtype=dtype, scale=2.0)  # row r holds the output of copy order[r]
    pos = torch.empty_like(order)
    pos[order] = torch.arange(T * top, device=order.device)
    want = torch.zeros(T, H, dtype=torch.float32, device=rows.device)
    for e in torch.unique(idx_).tolist():  # the reference's loop: expert by expert
        tok, k = torch.where(idx_ == e)
        want.index_add_(0, tok, rows[pos[tok * top + k]] * w[tok, k, None])
    check(moe_combine(rows, pos.view(T, top), w), want.to(dtype))


def check_mamba_chunk_inputs_and_skip(dtype: torch.dtype) -> None:
    """Mamba-2 prefill glue against the torch ops it replaces (in Mamba2Mixer.scan): x, B, C split from the
    activated conv output (rows strided), B and C expanded from groups to heads, v = x * dt, y + D * x."""
    for H, hd, G, N, P in ((6, 10, 3, 12, 9), (32, 40, 4, 48, 3)):  # the second: rows of several column blocks
        inter, gn = H * hd, G * N
        xc = rand(P, inter + 2 * gn + 5, dtype=dtype)[:, :inter + 2 * gn]  # a strided view, as the in_proj slices
        dt = rand(P, H).abs()
        q, k, v = mamba_chunk_inputs(xc, dt, H, hd, G, N)
        x, B, C = xc.float().split([inter, gn, gn], dim=-1)
        check(v, x.reshape(P, H, hd) * dt[..., None])
        check(k, B.reshape(P, G, N).repeat_interleave(H // G, dim=1))
        check(q, C.reshape(P, G, N).repeat_interleave(H // G, dim=1))
        y, D = rand(P, H, hd), rand(H, dtype=dtype)
        want = y + D.float()[:, None] * x.reshape(P, H, hd)
        check(mamba_skip_add(y.clone(), xc, D), want, atol=1e-5)  # the kernel may fuse the multiply-add


def check_mamba_decode_matches_reference_step(dtype: torch.dtype) -> None:
    """conv_step(act) + mamba_decode against Mamba2Mixer's reference decode (dt rounding, clamp, D skip), with
    rows that are a subset of the batch (the others stay zero) and one row starting from zeros; a state size that
    is a power of two and one that is not."""
    for state_size in (16, 12):
        _mamba_decode_case(dtype, state_size)


def _mamba_decode_case(dtype: torch.dtype, N: int) -> None:
    from hybridpd.engine.kernels.recurrent_step import conv_step, mamba_decode
    from hybridpd.engine.models.layers import causal_conv_step
    from hybridpd.engine.models.mamba2 import Mamba2Config, Mamba2Mixer

    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=8, n_groups=2, state_size=N, conv_kernel=4,
                       chunk_size=8, use_bias=False, use_conv_bias=True, activation="silu", norm_eps=1e-5,
                       time_step_min=0.01, ssm_dtype="float32")
    m = Mamba2Mixer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(rand(*p.shape, scale=0.5).cpu())
        m.dt_bias.copy_(rand(4).cpu() - 2.0)  # some dt below time_step_min: the clamp is exercised
    m = m.to(dtype).to(DEVICE)
    T, C = 5, cfg.conv_dim
    xbc = rand(T, C + 3, dtype=dtype)[:, :C]  # strided rows
    dt_raw = rand(T, 4, dtype=dtype)
    rows = idx(0, 2, 3)
    slots = idx(1, 2, 3)
    has_init = idx(1, 0, 1, dtype=torch.int32)
    conv = rand(4, C, 3, dtype=dtype)
    ssm = rand(4, 4, 8, N)
    conv0, ssm0 = conv.clone(), ssm.clone()
    xc = conv_step(xbc, conv, m._conv_weight(), m.conv1d.bias, slots, has_init, rows, act=True)
    y = torch.zeros(T, 4, 8, device=DEVICE)
    mamba_decode(xc, dt_raw, m.dt_bias, m.A_log, m.D, ssm, slots, has_init, rows, y, 2, cfg.time_step_min)
    # reference, as Mamba2Mixer._decode computes it
    prev = conv0[slots] * has_init[:, None, None].to(dtype)
    h0 = ssm0[slots] * has_init[:, None, None, None]
    xc_ref, conv_new = causal_conv_step(xbc[rows], prev, m._conv_weight(), m.conv1d.bias)
    x, B, Cm = m._split(m.act(xc_ref))
    B, Cm = m._heads(B), m._heads(Cm)
    dt = m._dt(dt_raw[rows])
    A = -torch.exp(m.A_log.float())
    h = h0 * torch.exp(dt * A)[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    y_ref = torch.einsum("bhpn,bhn->bhp", h, Cm) + m.D.float()[:, None] * x
    check(xc, m.act(xc_ref))
    torch.testing.assert_close(conv[slots], conv_new.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if STRICT else 6e-2
    torch.testing.assert_close(ssm[slots], h, rtol=tol, atol=tol)
    torch.testing.assert_close(y[rows], y_ref, rtol=tol, atol=tol)
    assert torch.equal(y[idx(1, 4)], torch.zeros(2, 4, 8, device=DEVICE)) and torch.equal(ssm[0], ssm0[0])


def check_gdn_decode_matches_reference_step(dtype: torch.dtype) -> None:
    """conv_step(act) + gdn_decode against GatedDeltaNet's reference decode (q/k l2 norms, GQA, beta in the model
    dtype, g in fp32); a key head dim that is a power of two and one that is not."""
    for head_k_dim in (16, 12):
        _gdn_decode_case(dtype, head_k_dim)


def _gdn_decode_case(dtype: torch.dtype, KD: int) -> None:
    from hybridpd.engine.kernels.recurrent_step import conv_step, gdn_decode
    from hybridpd.engine.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
    from hybridpd.engine.models.layers import causal_conv_step

    cfg = GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=KD, head_v_dim=8,
                              conv_kernel=4, activation="silu", norm_eps=1e-6)
    m = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(rand(*p.shape, scale=0.5).cpu())
    m = m.to(dtype).to(DEVICE)
    T, C = 4, cfg.conv_dim
    proj = rand(T, C + 8, dtype=dtype)
    qkv, b, a = proj[:, :C], proj[:, C:C + 4], proj[:, C + 4:]
    rows = idx(1, 3)
    slots = idx(2, 1)
    has_init = idx(1, 0, dtype=torch.int32)
    conv = rand(3, C, 3, dtype=dtype)
    state = rand(3, 4, KD, 8)
    conv0, state0 = conv.clone(), state.clone()
    xc = conv_step(qkv, conv, m._conv_weight(), m.conv1d.bias, slots, has_init, rows, act=True)
    out = torch.zeros(T, 4, 8, device=DEVICE)
    gdn_decode(xc, a, b, m.A_log, m.dt_bias, state, slots, has_init, rows, out, 2)
    prev = conv0[slots] * has_init[:, None, None].to(dtype)
    s0 = state0[slots] * has_init[:, None, None, None]
    xc_ref, _ = causal_conv_step(qkv[rows], prev, m._conv_weight(), m.conv1d.bias)
    q, k, v = m._split(m.act(xc_ref))
    q, k = m._heads(q), m._heads(k)
    beta = b[rows].sigmoid().float()
    g = -torch.exp(m.A_log.float()) * torch.nn.functional.softplus(a[rows].float() + m.dt_bias.float())
    s = s0 * torch.exp(g)[:, :, None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[:, :, None]
    s = s + k[..., None] * delta[:, :, None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if STRICT else 6e-2
    torch.testing.assert_close(state[slots], s, rtol=tol, atol=tol)
    torch.testing.assert_close(out[rows], o, rtol=tol, atol=tol)
    assert torch.equal(out[idx(0, 2)], torch.zeros(2, 4, 8, device=DEVICE))


def check_conv_varlen_matches_reference_chunks(dtype: torch.dtype) -> None:
    """conv_varlen over two sequences in one extended buffer (state rows, then tokens) against the reference
    causal_conv_chunk of each sequence, pre-activation and with silu."""
    from hybridpd.engine.kernels.recurrent_step import conv_varlen
    from hybridpd.engine.models.layers import causal_conv_chunk

    C, K, lens = 40, 4, (7, 3)
    w, b = rand(C, K, dtype=dtype), rand(C, dtype=dtype)
    xs = [rand(n, C, dtype=dtype) for n in lens]
    inits = [rand(C, K - 1, dtype=dtype), None]
    parts, ext_x, row = [], [], 0
    for x, init in zip(xs, inits, strict=True):
        parts += [(init if init is not None else torch.zeros(C, K - 1, dtype=dtype, device=DEVICE)).t(), x]
        ext_x += list(range(row + K - 1, row + K - 1 + x.shape[0]))
        row += K - 1 + x.shape[0]
    ext = torch.cat(parts).contiguous()
    pos = idx(*ext_x)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731 - the reference on CPU (no TF32 convolution)
    want = torch.cat([causal_conv_chunk(x.cpu(), cpu(init), w.cpu(), b.cpu(), [])[0]
                      for x, init in zip(xs, inits, strict=True)]).to(DEVICE)
    atol = 1e-6 if STRICT else 8 * 2**-7  # a sum of K products can cancel: bound the interpreter's truncations
    check(conv_varlen(ext, w, b, pos), want, atol)
    check(conv_varlen(ext, w, b, pos, act=True), torch.nn.functional.silu(want), atol)




def check_paged_attention_across_key_tiles(dtype: torch.dtype) -> None:
    """paged_attention_varlen against dense causal softmax attention per sequence (fp32), with contexts of several
    key tiles: the tiles left of the causal diagonal run unmasked, the rest masked. A decode, a prefill with no
    prefix (long enough for the 128-row bf16 tiles), a chunk after a cached prefix, a padded row (ctx_len 0); then
    a decode-only step (the split-KV kernels: key ranges merged). The block table is shuffled and the unused cache
    rows hold NaN, which must not leak."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return  # Triton's interpreter returns values of 1e8 here for bf16, from the kernel before the tile split too
    for seqs in ([(1, 203), (150, 150), (70, 260), (1, 0)], [(1, 203), (1, 17), (1, 64), (1, 0), (1, 1)]):
        _check_attention(dtype, seqs)


def check_paged_attention_any_group_and_head_dim(dtype: torch.dtype) -> None:
    """The same for GQA groups and head dims that are not powers of two (Nemotron-Nano-9B-v2: 40 heads on 8 KV
    heads, Qwen3.5-27B: 24 on 4; head dims like 80 or 96): prefill tiles, a chunk after a prefix, decodes."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return  # as above: the interpreter's bf16 dots
    for H, KVH, D in ((10, 2, 24), (24, 1, 20), (6, 2, 32)):
        for seqs in ([(1, 40), (20, 45), (1, 0)], [(1, 33), (1, 5), (1, 0)]):
            _check_attention(dtype, seqs, H, KVH, D)


def _check_attention(dtype: torch.dtype, seqs: list[tuple[int, int]], H: int = 4, KVH: int = 2, D: int = 32) -> None:
    from hybridpd.engine.kernels.paged_attention import paged_attention_varlen

    bs = 16
    n_blocks = sum(-(-c // bs) for _, c in seqs) + 3
    cache = torch.full((n_blocks, 2, bs, KVH, D), float("nan"), dtype=dtype)
    perm = torch.randperm(n_blocks, generator=GEN).tolist()
    width = max(-(-c // bs) for _, c in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    T = sum(q for q, _ in seqs) + 2  # two rows of no sequence
    q = rand(T, H, D, dtype=dtype)
    want = torch.zeros(T, H, D)
    starts, pos = [], 0
    for j, (ql, cl) in enumerate(seqs):
        blocks = [perm.pop() for _ in range(-(-cl // bs))]
        table[j, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        kv = rand(2, cl, KVH, D, dtype=dtype).cpu()
        for p in range(cl):
            cache[blocks[p // bs], :, p % bs] = kv[:, p]
        starts.append(pos)
        if ql and cl:
            qf = q[pos:pos + ql].float().cpu().view(ql, KVH, H // KVH, D)
            scores = torch.einsum("ikgd,pkd->kgip", qf, kv[0].float()) * D ** -0.5
            visible = torch.arange(cl)[None, :] <= (cl - ql + torch.arange(ql))[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            want[pos:pos + ql] = torch.einsum("kgip,pkd->ikgd", probs, kv[1].float()).reshape(ql, H, D)
        pos += ql
    meta = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (starts, [s[0] for s in seqs],
                                                                         [s[1] for s in seqs])]
    got = paged_attention_varlen(q, cache.to(DEVICE), *meta, table.to(DEVICE), max(s[0] for s in seqs), D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: probabilities rounded to bf16 before P @ V
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


def check_rope_partial_on_strided_heads(dtype: torch.dtype) -> None:
    """fused.rope against layers.apply_rotary: partial rotary (a quarter of the head, as Qwen3.5), rows strided as
    the q chunk of Qwen3.5's q projection."""
    from hybridpd.engine.kernels.fused import rope
    from hybridpd.engine.models.layers import RotaryEmbedding, apply_rotary

    T, H, D = 5, 3, 32
    x = rand(T, H, 2 * D, dtype=dtype)[..., :D]  # the q half of [q | gate], as the model chunks it
    cos, sin = RotaryEmbedding(D // 4, 10000.0).cos_sin(idx(0, 1, 7, 300, 4095), dtype)
    check(rope(x, cos, sin), apply_rotary(x, cos, sin))


def check_sigmoid_gate(dtype: torch.dtype) -> None:
    """fused.sigmoid_gate against out * torch.sigmoid(gate) with the gate a strided chunk of a wider row."""
    from hybridpd.engine.kernels.fused import sigmoid_gate

    n, H, W = 4, 6, 40
    gate = rand(n, H, 2 * W, dtype=dtype, scale=3.0)[..., W:]
    x = rand(n, H * W, dtype=dtype)
    check(sigmoid_gate(x, gate), x * torch.sigmoid(gate.reshape(n, -1)))


def check_names() -> list[str]:
    return sorted(n[len("check_"):] for n in globals() if n.startswith("check_") and n != "check_names")


def run_check(name: str, dtype: torch.dtype, device: str, strict: bool) -> None:
    """Run check_<name> on `device` (the per-dtype checks in `dtype`; the others once, in fp32 only)."""
    import zlib

    setup(device, strict)
    GEN.manual_seed(zlib.crc32(name.encode()))  # the same inputs whatever ran before
    fn = globals()["check_" + name]
    if name == "rms_norm_with_and_without_residual":
        for zero_centered in (False, True):
            fn(dtype, zero_centered)
    elif name == "rms_norm_per_head_of_a_strided_view":
        if dtype == torch.float32:
            fn()
    else:
        fn(dtype)
