"""Admission control in isolation (`proxy.admission`, `proxy.api_keys`, `proxy.request_limits`): exact budgets,
tenant shares, wait order, timeouts, per-key limits and the 400s for oversized requests. No network."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hybridpd.proxy.admission import Admission, Demand, Ticket
from hybridpd.proxy.api_keys import ApiKey, find_key, parse_keys
from hybridpd.proxy.config import AdmissionLimits, ProxyConfig, RequestLimits
from hybridpd.proxy.errors import ApiError
from hybridpd.proxy.openai_schema import parse_completion
from hybridpd.proxy.request_limits import check_body_limits, check_request_limits
from prometheus_client import CollectorRegistry


def make(**limits: Any) -> Admission:
    cfg = ProxyConfig(decode_addrs=("d:1",), colocated=True, max_model_len=1000, admission=AdmissionLimits(**limits))
    return Admission(cfg, CollectorRegistry())


def seqs(n: int, prompt: int = 10, reserved: int = 20) -> Demand:
    return Demand(seqs=n, prompt_tokens=prompt, reserved_tokens=reserved)


async def admit(a: Admission, tenant: str, d: Demand, key: ApiKey | None = None) -> Ticket:
    return await a.admit(a.tenant(tenant, key), d)


async def raises(status: int, aw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        await aw
    assert info.value.status == status, info.value.message
    return info.value


def rejected(a: Admission, reason: str) -> float:
    return a.rejected.labels(reason=reason)._value.get()


def test_defaults_scale_with_workers() -> None:
    cfg = ProxyConfig(decode_addrs=("d:1", "d:2"), prefill_addrs=("p:1",), max_model_len=1000)
    a = Admission(cfg, CollectorRegistry())
    assert (a.caps.seqs, a.caps.prompt_tokens, a.caps.reserved_tokens) == (512, 64_000, None)
    assert (a.tenant_caps.seqs, a.tenant_caps.prompt_tokens) == (256, 32_000)


def test_never_fits_is_400_and_counted() -> None:
    async def run() -> None:
        a = make(max_num_seqs=8, max_tenant_share=0.5, max_tokens_in_flight=100)
        err = await raises(400, admit(a, "x", seqs(5)))  # 5 > the tenant's 4
        assert err.code == "request_too_large" and "5 sequences" in err.message
        await raises(400, admit(a, "x", seqs(1, reserved=60)))  # 60 > half of 100
        assert rejected(a, "never_fits") == 2 and a.used.seqs == 0 and a.check_integrity()

    asyncio.run(run())


def test_waits_then_admitted_when_room_frees() -> None:
    async def run() -> None:
        a = make(max_num_seqs=4, max_tenant_share=1.0, queue_timeout_s=5)
        first = await admit(a, "x", seqs(3))
        waiting = asyncio.ensure_future(admit(a, "y", seqs(2)))
        await asyncio.sleep(0.01)
        assert not waiting.done() and a.waiting == 1
        first.release()
        second = await asyncio.wait_for(waiting, 1)
        assert a.used.seqs == 2 and a.waiting == 0 and a.check_integrity()
        second.release()
        second.release()  # idempotent
        assert a.used.seqs == 0 and a.check_integrity()

    asyncio.run(run())


def test_cancelled_as_it_is_granted_gives_the_budget_back() -> None:
    """A waiter granted room in the same instant its caller gives up (the client left) is cancelled and the room
    goes back: asyncio.wait_for returned the grant despite the cancellation, so the caller (which no longer waited
    for it) dropped a Ticket nobody released, and the proxy's budget shrank for good (streams cancelled under load
    leaked dozens of sequences)."""

    async def run() -> None:
        a = make(max_num_seqs=2, max_tenant_share=1.0, queue_timeout_s=5)
        first = await admit(a, "x", seqs(2))
        waiting = asyncio.ensure_future(admit(a, "y", seqs(2)))
        await asyncio.sleep(0.01)
        first.release()  # grants the waiter ...
        waiting.cancel()  # ... whose caller gives up before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert a.used.seqs == 0 and a.waiting == 0 and a.check_integrity()

    asyncio.run(run())


def test_queue_timeout_and_queue_full_are_503_with_retry_after() -> None:
    async def run() -> None:
        a = make(max_num_seqs=2, max_tenant_share=1.0, queue_timeout_s=0.05, max_waiting=1)
        held = await admit(a, "x", seqs(2))
        err = await raises(503, admit(a, "y", seqs(1)))
        assert err.headers["Retry-After"] == "1" and err.code == "overloaded" and rejected(a, "queue_timeout") == 1
        waiting = asyncio.ensure_future(admit(a, "y", seqs(1)))
        await asyncio.sleep(0.01)
        await raises(503, admit(a, "z", seqs(1)))  # the one waiting slot is taken
        assert rejected(a, "queue_full") == 1
        held.release()
        (await waiting).release()
        assert a.used == type(a.used)() and a.check_integrity()

    asyncio.run(run())


def test_one_tenant_holds_at_most_its_share() -> None:
    async def run() -> None:
        a = make(max_num_seqs=8, max_tenant_share=0.5, queue_timeout_s=0.05)
        flood = [await admit(a, "mallory", seqs(2)) for _ in range(2)]
        await raises(503, admit(a, "mallory", seqs(1)))  # at 4 of 8: mallory's share is full, the budget is not
        legit = await admit(a, "alice", seqs(4))
        assert a.used.seqs == 8
        for t in [*flood, legit]:
            t.release()
        assert a.check_integrity()

    asyncio.run(run())


def test_waiters_served_least_loaded_tenant_first() -> None:
    async def run() -> None:
        a = make(max_num_seqs=4, max_tenant_share=1.0, queue_timeout_s=5)
        m = await admit(a, "mallory", seqs(3))
        a_ = await admit(a, "alice", seqs(1))
        order: list[str] = []

        async def wait(tenant: str) -> Ticket:
            t = await admit(a, tenant, seqs(1))
            order.append(tenant)
            return t

        w1 = asyncio.ensure_future(wait("mallory"))  # arrives first
        await asyncio.sleep(0.01)
        w2 = asyncio.ensure_future(wait("bob"))
        await asyncio.sleep(0.01)
        a_.release()  # one sequence frees: bob (holding 0) goes before mallory (holding 3)
        await asyncio.sleep(0.01)
        assert order == ["bob"]
        m.release()
        await asyncio.wait_for(w1, 1)
        assert order == ["bob", "mallory"]
        (await w2).release()
        (await w1).release()
        assert a.used.seqs == 0 and a.check_integrity()

    asyncio.run(run())


def test_prompt_tokens_stop_counting_after_first_output() -> None:
    async def run() -> None:
        a = make(max_num_seqs=100, max_queued_prompt_tokens=100, max_tenant_share=1.0, queue_timeout_s=0.05)
        t = await admit(a, "x", Demand(seqs=1, prompt_tokens=80, reserved_tokens=90))
        await raises(503, admit(a, "x", Demand(seqs=1, prompt_tokens=30, reserved_tokens=40)))
        t.prompts_done()
        t2 = await admit(a, "x", Demand(seqs=1, prompt_tokens=30, reserved_tokens=40))
        assert a.used.prompt_tokens == 30 and a.used.seqs == 2
        t.release()
        t2.release()
        assert a.used.prompt_tokens == 0 and a.check_integrity()

    asyncio.run(run())


def test_cancelled_waiter_leaves_no_trace() -> None:
    async def run() -> None:
        a = make(max_num_seqs=1, max_tenant_share=1.0, queue_timeout_s=5)
        held = await admit(a, "x", seqs(1))
        w = asyncio.ensure_future(admit(a, "y", seqs(1)))
        await asyncio.sleep(0.01)
        w.cancel()  # the client went away while waiting
        await asyncio.sleep(0.01)
        assert a.waiting == 0
        held.release()
        assert a.used.seqs == 0 and a.check_integrity()

    asyncio.run(run())


def test_key_concurrency_and_tokens_per_minute_are_429() -> None:
    async def run() -> None:
        a = make(max_num_seqs=100, max_tenant_share=1.0)
        key = ApiKey("alice", "sk-a", max_concurrency=3, tokens_per_minute=600)
        t = await admit(a, "key:alice", seqs(2, reserved=400), key)
        err = await raises(429, admit(a, "key:alice", seqs(2, reserved=10), key))
        assert err.code == "rate_limit_exceeded" and rejected(a, "key_concurrency") == 1
        err = await raises(429, admit(a, "key:alice", seqs(1, reserved=300), key))  # 200 left of 600 per minute
        assert int(err.headers["Retry-After"]) >= 10 and rejected(a, "key_tokens_per_minute") == 1
        t.release(unused_tokens=300)  # only 100 of the 400 reserved were used
        (await admit(a, "key:alice", seqs(1, reserved=450), key)).release()
        await raises(400, admit(a, "key:alice", seqs(4), key))  # 4 > max_concurrency: never
        await raises(400, admit(a, "key:alice", seqs(1, reserved=601), key))  # > a minute's tokens: never

    asyncio.run(run())


def test_keys_file() -> None:
    keys = parse_keys("# comment\nalice sk-a max_concurrency=4\n\nbob sk-b tokens_per_minute=10  # x\n",
                      max_concurrency=9, tokens_per_minute=7)
    assert [(k.name, k.max_concurrency, k.tokens_per_minute) for k in keys] == [("alice", 4, 7), ("bob", 9, 10)]
    assert find_key(keys, "sk-b") == keys[1] and find_key(keys, "sk-c") is None
    assert "sk-a" not in repr(keys)
    for bad in ("alice\n", "alice sk-a rate=3\n", "a k max_concurrency=x\n", "a k1\na k2\n", "a k\nb k\n"):
        with pytest.raises(ValueError):
            parse_keys(bad)


def test_request_limits() -> None:
    limits = RequestLimits(max_stop_strings=2, max_stop_string_chars=5, max_logit_bias=2, max_prompts=2,
                           max_stop_token_ids=2)
    ok = {"prompt": ["a", "b"], "stop": ["ab", "cd"], "logit_bias": {"1": 1, "2": 2}, "stop_token_ids": [1, 2]}
    check_body_limits(ok, limits)
    check_request_limits(parse_completion(ok, "m"), limits)
    for field, value in (("stop", ["a", "b", "c"]), ("stop", ["abcdef"]), ("logit_bias", {"1": 1, "2": 2, "3": 3}),
                         ("prompt", ["a", "b", "c"]), ("stop_token_ids", [1, 2, 3])):
        with pytest.raises(ApiError) as info:
            check_request_limits(parse_completion({**ok, field: value}, "m"), limits)
        assert (info.value.status, info.value.param, info.value.code) == (400, field, "limit_exceeded")
        if value != ["abcdef"]:  # list sizes are refused before the schema looks at the elements
            with pytest.raises(ApiError) as info:
                check_body_limits({**ok, field: value}, limits)
            assert (info.value.status, info.value.param) == (400, field)
    check_body_limits({"prompt": [1, 2, 3]}, limits)  # one prompt of token ids, not three prompts


def test_cli_flags_reach_the_proxy_config(tmp_path: Any) -> None:
    from hybridpd.deploy.cli import build_parser
    from hybridpd.deploy.commands import ConfigError, proxy_limits
    from hybridpd.deploy.proxy_flags import serve_max_seqs

    keys = tmp_path / "keys"
    keys.write_text("alice sk-a max_concurrency=4\nbob sk-b\n")
    args = build_parser().parse_args(["proxy", "--decode", "d:1", "--admission-max-seqs", "40", "--api-keys-file",
                                      str(keys), "--key-tokens-per-minute", "900", "--max-stop-strings", "3",
                                      "--max-schema-depth", "7", "--header-timeout", "2.5", "--max-connections", "9"])
    kw = proxy_limits(args)
    assert kw["admission"].max_num_seqs == 40 and kw["request_limits"].max_stop_strings == 3
    assert kw["request_limits"].max_schema_depth == 7
    assert (kw["http"].header_timeout_s, kw["http"].max_connections) == (2.5, 9)
    assert [(k.name, k.max_concurrency, k.tokens_per_minute) for k in kw["api_keys"]] == [("alice", 4, 900),
                                                                                          ("bob", 0, 900)]
    serve = build_parser().parse_args(["serve", "--num-decode", "2", "--max-num-seqs", "8"])
    assert serve_max_seqs(serve) == 64 and proxy_limits(serve, 64)["admission"].max_num_seqs == 64
    for bad in (["--admission-tenant-share", "2"], ["--api-keys-file", str(tmp_path / "missing")]):
        with pytest.raises(ConfigError):
            proxy_limits(build_parser().parse_args(["proxy", "--decode", "d:1", *bad]))
