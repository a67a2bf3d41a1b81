"""Errors the engine raises on purpose (as opposed to bugs).

`HybridPDError` is the root; callers that turn errors into HTTP or gRPC statuses catch it and map the subclasses:
`InvalidRequestError` is the client's fault (4xx), `ModelLoadError` is the operator's (bad model directory).
"""

from __future__ import annotations


class HybridPDError(Exception):
    """Base class of every error hybridpd raises deliberately."""


class ModelLoadError(HybridPDError):
    """The model directory cannot be loaded: missing files, bad config, unsupported architecture, bad weights."""


class InvalidRequestError(HybridPDError, ValueError):
    """A request is malformed or cannot be served (bad parameters, prompt too long, ...)."""


__all__ = ["HybridPDError", "ModelLoadError", "InvalidRequestError"]
