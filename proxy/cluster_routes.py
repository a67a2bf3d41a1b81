"""HTTP routes of live membership (proxy/membership.py):

    POST   /v1/cluster/workers   {"role", "address", "worker_id", "epoch", "ttl_s"}   register / heartbeat
    DELETE /v1/cluster/workers   {"address"}                                         leave
        both need the cluster token as header `x-hybridpd-token` when the proxy has one (what workers hold); a
        proxy that requires API keys but has no cluster token refuses both (403 membership_closed): nothing could
        tell a worker from anyone who reaches the proxy, and an API key is a client's, not a worker's;
    POST   /v1/cluster/drain     {"address", "drain": true|false}                    drain / undrain
        needs the API key (an operator's call), like GET /v1/cluster.

Bad input is a 400 with an OpenAI-style error body; an unknown worker a 404.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from hybridpd.proxy.credentials import TOKEN_METADATA_KEY
from hybridpd.proxy.errors import ApiError, bad_request
from hybridpd.proxy.membership import Membership, MembershipFullError
from hybridpd.proxy.openai_schema import parse_json_object

log = logging.getLogger(__name__)

MAX_TTL_S = 300.0


def _field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None or not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise bad_request(f"'{name}' must be a {kind.__name__}", param=name)
    return value


def _address(body: dict[str, Any]) -> str:
    addr = _field(body, "address", str)
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(addr) > 300:
        raise bad_request(f"'address' must be host:port, got {addr!r}", param="address")
    return addr


def add_cluster_routes(
    app: FastAPI,
    membership: Membership,
    cluster_token: str | None,
    check_api_key: Callable[[Request], None],
    api_keys_required: bool = False,
) -> None:
    """`api_keys_required`: the proxy's API needs a key (without a cluster token, membership is then closed)."""
    if cluster_token is None and api_keys_required:
        log.warning(
            "API keys are required but there is no cluster token (--cluster-token-file / HYBRIDPD_CLUSTER_TOKEN): "
            "workers cannot register (static --prefill / --decode workers only)"
        )

    def check_token(request: Request) -> None:
        if cluster_token is None:
            if api_keys_required:
                raise ApiError(
                    403,
                    "this proxy takes no worker registrations: it requires API keys and has no cluster token to "
                    "authenticate workers (give the proxy and the workers --cluster-token-file)",
                    code="membership_closed",
                )
            return
        given = request.headers.get(TOKEN_METADATA_KEY, "")
        if not secrets.compare_digest(given.encode(), cluster_token.encode()):
            raise ApiError(
                401, f"invalid or missing cluster token (header {TOKEN_METADATA_KEY})", code="invalid_cluster_token"
            )

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json_object(await request.body())

    @app.post("/v1/cluster/workers")
    async def register(request: Request) -> dict[str, Any]:
        check_token(request)
        body = await body_of(request)
        role = _field(body, "role", str)
        if role not in ("prefill", "decode"):
            raise bad_request("'role' must be 'prefill' or 'decode'", param="role")
        ttl = body.get("ttl_s", 10.0)
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_TTL_S:
            raise bad_request(f"'ttl_s' must be in (0, {MAX_TTL_S:g}]", param="ttl_s")
        try:
            m = membership.register(
                role,
                _address(body),
                str(body.get("worker_id", ""))[:64],
                str(body.get("epoch", ""))[:64],
                ttl,
                draining=bool(body["draining"]) if isinstance(body.get("draining"), bool) else None,
            )
        except ValueError as e:
            raise bad_request(str(e), param="role") from None
        except MembershipFullError as e:
            raise ApiError(429, str(e), code="membership_full") from None
        return {"registered": True, "address": m.address, "state": "draining" if m.draining else "up"}

    @app.delete("/v1/cluster/workers")
    async def leave(request: Request) -> dict[str, Any]:
        check_token(request)
        return {"removed": membership.deregister(_address(await body_of(request)))}

    @app.post("/v1/cluster/drain")
    async def drain(request: Request) -> dict[str, Any]:
        check_api_key(request)
        body = await body_of(request)
        addr = _address(body)
        on = bool(_field(body, "drain", bool, True))
        try:
            m = membership.drain(addr, on)
        except KeyError:
            raise ApiError(404, f"no worker at {addr}", code="not_found") from None
        told = await membership.tell_worker_draining(addr, on)  # so every other proxy learns it too
        return {"address": addr, "draining": m.draining, "worker_told": told}
