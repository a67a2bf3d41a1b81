"""The PD handoff fails closed, over real processes, gRPC and NIXL (CPU):

- the stale lease: P's lease ends and its pages are reused by other requests before D pulls -> D refuses, recomputes,
  and answers (and caches) the right tokens;
- cache poisoning: Generate(prompt A, params of prompt B), with B's digest and with a digest forged to match A ->
  refused before the pull, or pulled and refused by P's Commit; A's later requests are right;
- altered pages: Generate(A, A's params carrying B's block ids and slots) -> P's Commit finds its signature broken,
  D recomputes, and three later requests for A through the proxy are right;
- the cluster token over mutual TLS: plaintext fails; without the token every worker RPC (Prefill, Release, Generate,
  Abort, Stats) is UNAUTHENTICATED;
  with it the proxy serves requests end to end.
Every refusal is counted in hybridpd_kv_transfer_failures_total."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from hybridpd.deploy.local_cluster import Cluster, start_cluster
from hybridpd.engine import LLM, SamplingParams
from hybridpd.kvtransfer.binding import prompt_digest
from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proto import hybridpd_pb2_grpc as pb_grpc

from tests.oracle import random_prompts
from tests.support.param_attacks import with_pages_of

pytestmark = pytest.mark.slow
NEW = 8
MODEL = "nemotron_attn_mid"


def _sp() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _prefill(c: Cluster, rid: str, prompt: list[int]) -> pb.TransferParams:
    with grpc.insecure_channel(c.prefill[0].info["address"]) as ch:
        return pb_grpc.PrefillServiceStub(ch).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=_sp()), timeout=60,
            metadata=c.grpc_metadata).params


_FIRST: dict[tuple[int, ...], int] = {}
"""prompt -> the colocated engine's first token (`_expected` fills it): what the proxy hands D with P's params."""


def _generate(c: Cluster, rid: str, prompt: list[int], params: pb.TransferParams | None) -> list[int]:
    """The output as the client sees it: with params, the first token (P's, as the proxy streamed it), then D's."""
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=_sp())
    first: list[int] = []
    if params is not None:
        req.params.CopyFrom(params)
        first = [_FIRST[tuple(prompt)]]
        req.first_token.token_id = first[0]
    with grpc.insecure_channel(c.decode[0].info["address"]) as ch:
        return first + [t for chunk in pb_grpc.DecodeServiceStub(ch).Generate(req, timeout=120,
                                                                               metadata=c.grpc_metadata)
                        for t in chunk.token_ids]


def _expected(model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=model, checkpoint_interval=32, kv_cache_memory_bytes=32 * 2**20)
    outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=NEW, temperature=0, ignore_eos=True))]
    _FIRST.update({tuple(p): o[0] for p, o in zip(prompts, outs, strict=True)})
    return outs


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # state LISTEN, owned by pid
                out.append(f[1].rsplit(":", 1)[0])
    return out


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _failures(c: Cluster, role: str, reason: str) -> float:
    w = c.prefill[0] if role == "prefill" else c.decode[0]
    return c.metric(w, "hybridpd_kv_transfer_failures_total", role=role, reason=reason)


def test_stale_lease_and_forged_params_never_give_wrong_tokens(checkpoint_dir):  # type: ignore[no-untyped-def]
    model = checkpoint_dir(MODEL)
    prompts = random_prompts([100, 100, 100, 100], vocab=256, seed=21)
    expected = _expected(model, prompts)
    c = start_cluster(model, worker_args=["--checkpoint-interval", "32", "--lease-seconds", "2"])
    try:
        # the stale lease: A's lease expires, other prompts reuse P's freed pages, then D gets A's params
        tp_a = _prefill(c, "a", prompts[0])
        time.sleep(2.5)
        for i in (2, 3):
            assert _generate(c, f"other{i}", prompts[i], _prefill(c, f"other{i}", prompts[i])) == expected[i]
        assert _generate(c, "a", prompts[0], tp_a) == expected[0]
        assert _failures(c, "decode", "lease_expired") == 1
        assert _generate(c, "a-again", prompts[0], None) == expected[0]  # D's cache holds A's real KV

        # poisoning: B's params for prompt A, first as P issued them, then with the digest rewritten to A's
        a, b = prompts[1], prompts[2]
        assert _generate(c, "x1", a, _prefill(c, "b1", b)) == expected[1]
        assert _failures(c, "decode", "prompt_mismatch") == 1
        forged = _prefill(c, "b2", b)
        forged.prompt_digest = prompt_digest(a, len(a))
        assert _generate(c, "b2", a, forged) == expected[1]
        assert _failures(c, "decode", "lease_lost") == 1
        assert _failures(c, "prefill", "commit_params_forged") == 1  # P's signature no longer matches
        assert _generate(c, "a-later", a, None) == expected[1]

        # altered pages: A's params (signed by P) carrying B's block ids and state slots. D pulls B's KV; P's Commit
        # finds its signature broken; D recomputes A. Later requests for A through the proxy are right.
        tp_a, tp_b = _prefill(c, "A", a), _prefill(c, "B", b)
        assert _generate(c, "A", a, with_pages_of(tp_a, tp_b)) == expected[1]
        assert _failures(c, "prefill", "commit_params_forged") == 2
        assert _failures(c, "decode", "lease_lost") == 2
        for _ in range(3):
            r = httpx.post(f"{c.url}/v1/completions", json={"model": c.model_name, "prompt": a, "max_tokens": NEW,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[1], r.text
        assert _generate(c, "B", b, tp_b) == expected[2]  # B's own lease was left alone

        # nothing stays pinned or leaked once the leases are over
        deadline = time.time() + 10
        while c.worker_stats(c.prefill[0]).leases_pinned and time.time() < deadline:
            time.sleep(0.3)
        for w in (c.prefill[0], c.decode[0]):
            stats = c.worker_stats(w)
            assert stats.leases_pinned == 0
            assert all(pool.integrity_ok and pool.in_use == 0 for pool in stats.pools), stats
    finally:
        c.stop()


def _make_certs(d: Path) -> dict[str, str]:
    """A CA and one certificate for 127.0.0.1 (server and client use), by the openssl command."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=hybridpd-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "1", "-extfile", "ext.cnf")
    return {"HYBRIDPD_TLS_CERT_FILE": str(d / "node.pem"), "HYBRIDPD_TLS_KEY_FILE": str(d / "node.key"),
            "HYBRIDPD_TLS_CA_FILE": str(d / "ca.pem")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make test certificates")
def test_worker_rpcs_require_the_cluster_token_over_mutual_tls(checkpoint_dir, tmp_path):  # type: ignore[no-untyped-def]
    c = start_cluster(checkpoint_dir(MODEL), cluster_token="s3cret-token", tls_env=_make_certs(tmp_path))
    try:
        p_addr, d_addr = c.prefill[0].info["address"], c.decode[0].info["address"]
        prompt = random_prompts([40], vocab=256, seed=22)[0]
        with grpc.insecure_channel(p_addr) as plain:  # plaintext gets nowhere
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.PrefillServiceStub(plain).Stats(pb.StatsRequest(), timeout=10, metadata=c.grpc_metadata)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with c.channel(p_addr) as pch, c.channel(d_addr) as dch:
            p, d = pb_grpc.PrefillServiceStub(pch), pb_grpc.DecodeServiceStub(dch)
            calls = [
                lambda md: p.Prefill(pb.PrefillRequest(request_id="x", prompt_token_ids=prompt, sampling_params=_sp()),
                                     timeout=30, metadata=md),
                lambda md: p.Release(pb.ReleaseRequest(request_id="x"), timeout=10, metadata=md),
                lambda md: p.Stats(pb.StatsRequest(), timeout=10, metadata=md),
                lambda md: d.Abort(pb.AbortRequest(request_id="x"), timeout=10, metadata=md),
                lambda md: list(d.Generate(pb.GenerateRequest(request_id="y", prompt_token_ids=prompt,
                                                              sampling_params=_sp()), timeout=30, metadata=md)),
            ]
            for call in calls:
                for md in ((), (("x-hybridpd-token", "wrong"),)):
                    with pytest.raises(grpc.RpcError) as e:
                        call(md)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # with the token: the proxy (same token from the environment) serves a PD request end to end
        r = httpx.post(f"{c.url}/v1/completions", json={"model": c.model_name, "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert c.worker_stats(c.decode[0]).role == "decode"
        # idle workers cost (almost) nothing: no NIXL progress thread, step loops asleep until called (< 2 %)
        time.sleep(1.0)
        before = {w.proc.pid: _cpu_seconds(w.proc.pid) for w in c.prefill + c.decode}
        t0 = time.monotonic()
        time.sleep(5.0)
        busy = {pid: (_cpu_seconds(pid) - s0) / (time.monotonic() - t0) for pid, s0 in before.items()}
        assert all(share < 0.02 for share in busy.values()), busy
        # bound where told: every listener of the workers (gRPC, metrics, UCX after a transfer) is on loopback
        for w in c.prefill + c.decode:
            addrs = _listening_addresses(w.proc.pid)
            assert addrs and all(a in ("0100007F", "0000000000000000FFFF00000100007F") for a in addrs), addrs
    finally:
        c.stop()
