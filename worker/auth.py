"""The cluster token: a shared secret every internal gRPC call carries as metadata `x-hybridpd-token`.

Where it comes from (first found): `--cluster-token-file PATH`, env `HYBRIDPD_CLUSTER_TOKEN_FILE`, env
`HYBRIDPD_CLUSTER_TOKEN`. `hybridpd serve` makes a random one for its own workers when none is given. A worker
with a token refuses every RPC without it (UNAUTHENTICATED); a worker without one accepts all and says so at start.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

TOKEN_METADATA_KEY = "x-hybridpd-token"
TOKEN_ENV = "HYBRIDPD_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "HYBRIDPD_CLUSTER_TOKEN_FILE"


def load_cluster_token(path: str | None = None) -> str | None:
    """The configured token, or None. Raises ValueError for an unreadable or empty token file."""
    path = path or os.environ.get(TOKEN_FILE_ENV) or None
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the cluster token file {path}: {e}") from e
        if not token:
            raise ValueError(f"the cluster token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to pass with every call to a worker (empty without a token)."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry the cluster token (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
            yield  # pragma: no cover - makes this an async generator

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        got = next((v for k, v in (details.invocation_metadata or ()) if k == TOKEN_METADATA_KEY), None)
        if got is not None and hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary
