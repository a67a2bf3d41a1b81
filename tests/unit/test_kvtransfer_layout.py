"""kvtransfer layout, compatibility hash, handshake metadata codec and release notices (no NIXL needed)."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch
from hybridpd.kvtransfer import CacheLayout, GroupTensors, MetadataError, ProtocolMismatchError
from hybridpd.kvtransfer.agent import registration_spans
from hybridpd.kvtransfer.layout import PROTOCOL_VERSION, Region
from hybridpd.kvtransfer.metadata import WorkerMetadata, decode, encode
from hybridpd.kvtransfer.notify import ReleaseNotice, decode_release, encode_release


def caches(blocks: int = 10, slots: int = 4, dtype: torch.dtype = torch.float32, block_size: int = 16) -> list:
    attn = [torch.zeros(blocks, 2, block_size, 2, 8, dtype=dtype) for _ in range(2)]
    state = [(torch.zeros(slots, 3, 16), torch.zeros(slots, 2, 8, 8))]
    return [(0, "attention", attn), GroupTensors(1, "mamba2", state, [7])]


def test_from_tensors_describes_every_page() -> None:
    groups = caches()
    lay = CacheLayout.from_tensors(groups, model_id="m")
    assert [r.name for r in lay.regions] == ["g0.l0.kv", "g0.l1.kv", "g1.l7.conv", "g1.l7.ssm"]
    kv = lay.regions[0]
    assert (kv.base_addr, kv.page_bytes, kv.page_stride, kv.num_pages) == (groups[0][2][0].data_ptr(), 2048, 2048, 10)
    conv, ssm = lay.regions[2:]
    assert (conv.page_bytes, conv.num_pages, ssm.page_bytes, ssm.layer_id) == (192, 4, 512, 7)
    assert lay.group_ids == (0, 1) and lay.is_attention(0) and lay.kind(1) == "mamba2"
    assert lay.num_pages(0) == 10 and lay.num_pages(1) == 4
    assert lay.fingerprint["group.0.block_size"] == "16"
    assert lay.fingerprint["protocol"] == str(PROTOCOL_VERSION)


def test_strided_view_keeps_its_stride() -> None:
    big = torch.zeros(10, 3, 2, 16, 2, 8)  # [blocks, layers, ...]: a per-layer view strides over layers
    lay = CacheLayout.from_tensors([(0, "attention", [big[:, i] for i in range(3)])], model_id="m")
    assert [(r.page_bytes, r.page_stride) for r in lay.regions] == [(2048, 3 * 2048)] * 3
    assert registration_spans(lay.regions) == [(big.data_ptr(), 9 * 3 * 2048 + 2 * 2048 + 2048, 0, "")]


def test_registration_merges_overlapping_spans_only() -> None:
    """Views of one tensor overlap and become one registration; adjacent spans may be two allocations (a GPU
    registration must not cross one), so they stay apart; devices never merge."""
    a = Region("a", 0, 0, 0x10000, 100, 300, 10)  # span 0x10000 .. +2800
    b = Region("b", 0, 1, 0x10000 + 100, 100, 300, 10)  # interleaved with a: overlaps
    c = Region("c", 0, 2, 0x10000 + 2900, 64, 64, 4)  # starts where b ends: adjacent
    d = Region("d", 0, 3, 0x10000, 64, 64, 4, device_type="cpu", device_id=1)
    want = [(0x10000, 2900, 0, ""), (0x10000 + 2900, 256, 0, ""), (0x10000, 256, 1, "")]
    assert registration_spans((c, b, a, d)) == want


def test_non_contiguous_page_is_refused() -> None:
    t = torch.zeros(10, 16, 2, 2, 8).transpose(1, 2)
    with pytest.raises(ValueError, match="one page"):
        CacheLayout.from_tensors([(0, "attention", [t])], model_id="m")


def test_hash_ignores_addresses_and_pool_sizes_but_not_specs() -> None:
    base = CacheLayout.from_tensors(caches(), model_id="m")
    assert CacheLayout.from_tensors(caches(blocks=33, slots=9), model_id="m").compat_hash == base.compat_hash
    for other, key in [
        (CacheLayout.from_tensors(caches(), model_id="other"), "model_id"),
        (CacheLayout.from_tensors(caches(dtype=torch.bfloat16), model_id="m"), "group.0.layer.0.kv"),
        (CacheLayout.from_tensors(caches(block_size=32), model_id="m"), "group.0.block_size"),
        (
            CacheLayout.from_tensors(caches(), model_id="m", extra={"checkpoint_interval": "64"}),
            "extra.checkpoint_interval",
        ),
    ]:
        assert other.compat_hash != base.compat_hash
        assert any(d.startswith(key + ":") for d in base.diff(other)), base.diff(other)
    assert base.diff(CacheLayout.from_tensors(caches(), model_id="x")) == ["model_id: 'm' (here) != 'x' (peer)"]


def test_region_validation() -> None:
    with pytest.raises(ValueError, match="page_stride >= page_bytes"):
        Region("r", 0, 0, 0x1000, 100, 50, 4)
    with pytest.raises(ValueError, match="device_type"):
        Region("r", 0, 0, 0x1000, 100, 100, 4, device_type="tpu")


def meta() -> WorkerMetadata:
    return WorkerMetadata("P0", "P0@e1", "e1", CacheLayout.from_tensors(caches(), model_id="m"), b"\x00nixl-md\xff")


def test_metadata_roundtrip() -> None:
    m = meta()
    got = decode(encode(m))
    assert got == m
    assert got.layout.regions == m.layout.regions and got.nixl_metadata == b"\x00nixl-md\xff"


@pytest.mark.parametrize(
    ("mutate", "err", "msg"),
    [
        (lambda b: b[:20], MetadataError, "truncated"),
        (lambda b: b[:-1], MetadataError, "length"),
        (lambda b: b"XXXXXXXX" + b[8:], MetadataError, "magic"),
        (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], MetadataError, "checksum"),
        (lambda b: b[:8] + struct.pack(">H", PROTOCOL_VERSION + 1) + b[10:], ProtocolMismatchError, "v2"),
        (lambda b: "not bytes", MetadataError, "must be bytes"),
    ],
)
def test_metadata_corruption_is_refused(mutate, err, msg) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(err, match=msg):
        decode(mutate(encode(meta())))


def test_metadata_hash_must_match_fingerprint() -> None:
    bad = replace(meta(), layout=replace(meta().layout, compat_hash="0" * 32))
    with pytest.raises(MetadataError, match="compat hash"):
        decode(encode(bad))


def test_release_notice_roundtrip() -> None:
    assert decode_release(encode_release("req|1", "e9", True)) == ReleaseNotice("req|1", "e9", True)
    assert decode_release(encode_release("r", "e9", False)) == ReleaseNotice("r", "e9", False)
    assert decode_release(b"something else") is None
    with pytest.raises(ValueError):
        encode_release("r", "bad|epoch", True)


def test_stacked_group_is_one_region_per_tensor_with_per_layer_fingerprint() -> None:
    kv = torch.zeros(10, 3, 2, 16, 2, 8)  # [blocks, layers, 2, block_size, heads, dim]
    conv, ssm = torch.zeros(4, 2, 3, 16), torch.zeros(4, 2, 2, 8, 8)  # [slots, layers, ...]
    lay = CacheLayout.from_tensors(
        [GroupTensors(0, "attention", [kv], stacked=True), GroupTensors(1, "mamba2", [(conv, ssm)], [7, 9], True)],
        model_id="m",
    )
    assert [(r.name, r.page_bytes, r.page_stride, r.num_pages) for r in lay.regions] == [
        ("g0.stacked.kv", 3 * 2048, 3 * 2048, 10),
        ("g1.stacked.conv", 2 * 192, 2 * 192, 4),
        ("g1.stacked.ssm", 2 * 512, 2 * 512, 4),
    ]
    assert lay.regions[0].pages_contiguous and lay.regions[0].base_addr == kv.data_ptr()
    flat = CacheLayout.from_tensors(
        [(0, "attention", [kv[:, i] for i in range(3)]), GroupTensors(1, "mamba2", [(conv[:, 0], ssm[:, 0]),
                                                                                    (conv[:, 1], ssm[:, 1])], [7, 9])],
        model_id="m",
    )
    # same per-layer entries (dtype, page shape, block size); only the stacking differs, and it is named
    assert {k: v for k, v in lay.fingerprint.items() if "stacked" not in k} == flat.fingerprint
    assert lay.diff(flat) == [
        "group.0.stacked: 'layers' (here) != '<absent>' (peer)",
        "group.1.stacked: 'layers' (here) != '<absent>' (peer)",
    ]


def test_stacked_group_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="one entry"):
        CacheLayout.from_tensors([GroupTensors(0, "attention", [torch.zeros(4, 2, 8)] * 2, stacked=True)], model_id="m")
    with pytest.raises(ValueError, match="2 layer ids for 3 layers"):
        CacheLayout.from_tensors([GroupTensors(0, "attention", [torch.zeros(4, 3, 8)], [1, 2], True)], model_id="m")
    with pytest.raises(ValueError, match="one layer count"):
        CacheLayout.from_tensors([GroupTensors(1, "mamba2", [(torch.zeros(4, 3, 8), torch.zeros(4, 2, 8))], None,
                                               True)], model_id="m")
