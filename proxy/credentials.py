"""Where the proxy's secrets come from: the client API key and the cluster token for worker RPCs.

    API key        (clients -> proxy, `Authorization: Bearer KEY`):  --api-key-file PATH, env HYBRIDPD_API_KEY_FILE,
                   env HYBRIDPD_API_KEY, then --api-key (visible in `ps`: for tests and local use)
    cluster token  (proxy -> workers, gRPC metadata `x-hybridpd-token`): --cluster-token-file PATH,
                   env HYBRIDPD_CLUSTER_TOKEN_FILE, env HYBRIDPD_CLUSTER_TOKEN

The first source found wins. A named file that is unreadable or empty is an error (ValueError), never a silent
"no key". The proxy imports nothing from the workers: the metadata key is repeated here (worker/auth.py checks it).
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

API_KEY_ENV = "HYBRIDPD_API_KEY"
API_KEY_FILE_ENV = "HYBRIDPD_API_KEY_FILE"
CLUSTER_TOKEN_ENV = "HYBRIDPD_CLUSTER_TOKEN"
CLUSTER_TOKEN_FILE_ENV = "HYBRIDPD_CLUSTER_TOKEN_FILE"
TOKEN_METADATA_KEY = "x-hybridpd-token"


def _read_secret(path: str, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
    if not value:
        raise ValueError(f"the {what} file {path} is empty")
    return value


def _resolve(path: str | None, file_env: str, env: str, flag: str | None, what: str) -> str | None:
    path = path or os.environ.get(file_env) or None
    if path:
        return _read_secret(path, what)
    return os.environ.get(env) or flag or None


def resolve_api_key(path: str | None = None, flag: str | None = None) -> str | None:
    """The API key clients must present, or None (no auth)."""
    return _resolve(path, API_KEY_FILE_ENV, API_KEY_ENV, flag, "API key")


def resolve_cluster_token(path: str | None = None) -> str | None:
    """The token every worker RPC carries, or None (workers without a token accept any caller)."""
    return _resolve(path, CLUSTER_TOKEN_FILE_ENV, CLUSTER_TOKEN_ENV, None, "cluster token")


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata for one worker call (empty without a token)."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


TLS_CERT_ENV = "HYBRIDPD_TLS_CERT_FILE"
TLS_KEY_ENV = "HYBRIDPD_TLS_KEY_FILE"
TLS_CA_ENV = "HYBRIDPD_TLS_CA_FILE"


def worker_channel_credentials() -> grpc.ChannelCredentials | None:
    """TLS for the proxy's calls to workers that serve TLS (worker/auth.py): the CA that signed them
    (HYBRIDPD_TLS_CA_FILE) and, for workers that require client certificates, this proxy's own certificate and key
    (HYBRIDPD_TLS_CERT_FILE / HYBRIDPD_TLS_KEY_FILE). None (plaintext) when none is set."""
    paths = [os.environ.get(e) or None for e in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV)]
    if not any(paths):
        return None
    ca, cert, key = (_read_bytes(p) if p else None for p in paths)
    if (cert is None) != (key is None):
        raise ValueError("TLS needs both HYBRIDPD_TLS_CERT_FILE and HYBRIDPD_TLS_KEY_FILE, or neither")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the TLS file {path}: {e.strerror or e}") from None
