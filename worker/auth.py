"""The cluster token: a shared secret every internal gRPC call carries as metadata `x-hybridpd-token`.

Where it comes from (first found): `--cluster-token-file PATH`, env `HYBRIDPD_CLUSTER_TOKEN_FILE`, env
`HYBRIDPD_CLUSTER_TOKEN`. `hybridpd serve` makes a random one for its own workers when none is given, and hands it
to them as HYBRIDPD_CLUSTER_TOKEN_FILE, the path of an in-memory file (deploy/secret_files.py). A worker with a token
refuses every RPC without it (UNAUTHENTICATED); a worker without one accepts all and says so at start.

TLS (below): with a certificate and key (`--tls-cert-file/--tls-key-file`, env HYBRIDPD_TLS_CERT_FILE/_KEY_FILE)
workers serve gRPC over TLS; with a CA (`--tls-ca-file`, HYBRIDPD_TLS_CA_FILE) they also require client
certificates signed by it. Callers (the proxy, decode workers calling prefill workers) use the same files.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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


# -- TLS ----------------------------------------------------------------------------------------------------------
TLS_CERT_ENV = "HYBRIDPD_TLS_CERT_FILE"
TLS_KEY_ENV = "HYBRIDPD_TLS_KEY_FILE"
TLS_CA_ENV = "HYBRIDPD_TLS_CA_FILE"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for worker gRPC. `cert`/`key`: this process's certificate (served by workers, presented as a
    client certificate on calls). `ca`: the CA that signs every peer; with it, workers require client certificates
    (mutual TLS) and clients verify servers against it."""

    cert: str
    key: str
    ca: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        try:
            return (Path(self.cert).read_bytes(), Path(self.key).read_bytes(),
                    Path(self.ca).read_bytes() if self.ca else None)
        except OSError as e:
            raise ValueError(f"cannot read a TLS file: {e}") from e


def load_tls(cert: str | None = None, key: str | None = None, ca: str | None = None) -> TlsFiles | None:
    """TLS settings from flags, else env HYBRIDPD_TLS_{CERT,KEY,CA}_FILE; None without a certificate."""
    cert = cert or os.environ.get(TLS_CERT_ENV) or None
    key = key or os.environ.get(TLS_KEY_ENV) or None
    ca = ca or os.environ.get(TLS_CA_ENV) or None
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and its key (--tls-cert-file and --tls-key-file)")
    return TlsFiles(cert, key, ca)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def open_channel(address: str, tls: TlsFiles | None, options: Any = None) -> grpc.aio.Channel:
    """An aio channel to a worker: TLS (with our certificate as the client's) when configured."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    cert, key, ca = tls.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(address, creds, options=options)
