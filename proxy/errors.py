"""OpenAI-style errors: one exception type, its JSON body, and the mapping from worker gRPC status codes.

Body: `{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
Every 5xx response carries `Connection: close`: the client opens a fresh connection rather than reusing one the
server may be about to drop. A deadline that expired (the request's `request_timeout_s`) is a 504.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}

# Worker status codes that mean "the cluster cannot serve this now" (retryable) rather than a bug.
_UNAVAILABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
_BAD_INPUT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


class ApiError(Exception):
    """An error the client sees as an HTTP status and an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.counted = False  # already counted in hybridpd_requests_total (the app counts it otherwise)

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.status >= 500:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_rpc_error(err: grpc.aio.AioRpcError, role: str, address: str) -> ApiError:
    """Map a worker's gRPC failure: INVALID_ARGUMENT -> 400 with the worker's message; deadline -> 504;
    transient -> 503; else 500."""
    code = err.code()
    details = err.details() or code.name
    if code in _BAD_INPUT_CODES:
        return ApiError(400, details, code="invalid_request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return timeout_error(f"{role} worker {address}")
    if code in _UNAVAILABLE_CODES:
        return ApiError(503, f"{role} worker {address} unavailable: {code.name}: {details}", code="worker_unavailable")
    return ApiError(500, f"{role} worker {address} failed: {code.name}: {details}", code="worker_error")


def timeout_error(where: str) -> ApiError:
    return ApiError(504, f"the request's deadline expired waiting for {where}", code="timeout")
