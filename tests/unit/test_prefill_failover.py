"""A prefill worker that dies under a Prefill is replaced by another one: the request is answered, not failed.

Its death breaks its cache-event feed too, so membership marks it down (out of the router's routable members)
before the proxy decides whether another prefill worker is left to try."""

from __future__ import annotations

import grpc
from hybridpd.proto import hybridpd_pb2 as pb

from tests.support.live_stack import LiveStack


def test_a_prefill_worker_dying_under_a_prefill_is_replaced() -> None:
    s = LiveStack(n_prefill=2, n_decode=1, model_name="tiny", routing="round_robin")
    dying = s.prefill[0]

    async def die(request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        dying.prefills.append(request)
        s.app.state.proxy.membership.mark_down(dying.address)  # its feed broke as it died
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        raise AssertionError("unreachable")

    dying.Prefill = die  # type: ignore[method-assign]
    with s:
        r = s.http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3})
        assert len(dying.prefills) == 1  # the first request went to the dying worker
        assert r.status_code == 200, r.text
        assert len(s.prefill[1].prefills) == 1
