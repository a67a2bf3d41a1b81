"""kvtransfer layout, compatibility hash, handshake metadata codec and release notices (no NIXL needed)."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

from kvtransfer import CacheLayout, GroupTensors, MetadataError, ProtocolMismatchError
from kvtransfer.agent import registration_spans
from kvtransfer.layout import PROTOCOL_VERSION, Region
from kvtransfer.metadata import WorkerMetadata, decode, encode
from kvtransfer.notify import ReleaseNotice, decode_release, encode_release


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
