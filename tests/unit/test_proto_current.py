"""The committed gRPC stubs match proto/hybridpd.proto, import as `proto.*`, and keep proto3 presence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), "--check"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_stubs_import_from_package() -> None:
    from hybridpd.proto import hybridpd_pb2 as pb
    from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "hybridpd.v1"
    assert {s for s in pb.DESCRIPTOR.services_by_name} == {"PrefillService", "DecodeService"}
    assert hasattr(pb_grpc, "PrefillServiceStub") and hasattr(pb_grpc, "DecodeServiceServicer")


def test_presence_and_round_trip() -> None:
    from hybridpd.proto import hybridpd_pb2 as pb

    sp = pb.SamplingParams(max_tokens=4)
    assert not sp.HasField("temperature") and not sp.HasField("seed")
    sp.temperature = 0.0  # greedy is distinguishable from "unset"
    assert sp.HasField("temperature")
    req = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=sp)
    assert not req.HasField("params")  # colocated
    req.params.CopyFrom(pb.TransferParams(worker_id="p0", epoch="e1", num_computed_tokens=2, num_prompt_tokens=3,
                                          groups=[pb.GroupBlocks(group_id=0, block_ids=[5, 6])]))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req and back.HasField("params") and list(back.params.groups[0].block_ids) == [5, 6]
