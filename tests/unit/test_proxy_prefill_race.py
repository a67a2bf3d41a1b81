"""The proxy's request is cancelled (its client went away) just as P's answer arrived: the call to P ended OK, so P
keeps the lease for a decode worker, yet the answer with its lease token was dropped with the cancelled task, and
the proxy's Release by request id alone cannot end it (only the token holder may): the prompt's pages stayed pinned
until the lease expired. Now an answer that arrives for a caller that gave up is released with its token."""

from __future__ import annotations

import asyncio
from typing import Any

from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proxy.generation import _prefill_unless_frozen


class _Router:
    def __init__(self, members: int) -> None:
        self.members = [f"p{i}" for i in range(members)]
        self.addrs = self.members

    def is_unresponsive(self, addr: str) -> bool:
        return False


class _Clients:
    """P answers at once; as it does, the waiting proxy task is cancelled (before it resumes with the answer)."""

    def __init__(self) -> None:
        self.waiter: asyncio.Task[Any] | None = None
        self.released: list[tuple[str, str, str, str]] = []

    async def prefill_call(self, addr: str, req: pb.PrefillRequest, timeout: float) -> pb.PrefillResponse:
        answer: asyncio.Future[pb.PrefillResponse] = asyncio.get_running_loop().create_future()

        def arrive() -> None:  # (as a gRPC call's answer does: a future completed by the channel)
            answer.set_result(
                pb.PrefillResponse(request_id=req.request_id, params=pb.TransferParams(epoch="e1", lease_token="tok"))
            )
            assert self.waiter is not None
            self.waiter.cancel()  # before the waiter resumes with the answer

        asyncio.get_running_loop().call_later(0.01, arrive)
        return await answer

    def release_later(self, addr: str, request_id: str, epoch: str, lease_token: str = "") -> None:
        self.released.append((addr, request_id, epoch, lease_token))


def test_an_answer_that_arrives_for_a_cancelled_request_is_released_with_its_token() -> None:
    async def scenario(members: int) -> list[tuple[str, str, str, str]]:
        clients = _Clients()
        req = pb.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
        waiter = asyncio.ensure_future(_prefill_unless_frozen(clients, _Router(members), "p0", req, 5.0))  # type: ignore[arg-type]
        clients.waiter = waiter
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the waiter was meant to be cancelled as the answer arrived")
        await asyncio.sleep(0.05)
        return clients.released

    for members in (1, 2):  # one prefill worker (a plain call) or several (watched for freezes)
        assert asyncio.run(scenario(members)) == [("p0", "r1", "e1", "tok")]
