"""Shape limits of one request (`RequestLimits`): stop strings, stop token ids, logit_bias entries, prompts, and
the depth of structured-output schemas and length of regexes / grammars (proxy.schema_limits).

Each is a 400 naming the field and the limit. `check_body_limits` looks at the list sizes of the raw JSON before
the schema validates every element (60,000 stop strings cost the schema more than json.loads does);
`check_request_limits` checks the typed request (string lengths too). An oversized list costs the proxy one parse
and the workers nothing (a worker matches every stop string at every step).
"""

from __future__ import annotations

from typing import Any

from hybridpd.proxy.config import RequestLimits
from hybridpd.proxy.errors import ApiError, bad_request
from hybridpd.proxy.openai_schema import ChatRequest, CompletionRequest
from hybridpd.proxy.schema_limits import check_structured_limits


def _too_many(what: str, count: int, limit: int, param: str) -> ApiError:
    return bad_request(f"'{param}' holds {count} {what}; at most {limit} per request", param=param,
                       code="limit_exceeded")


def check_body_limits(body: dict[str, Any], limits: RequestLimits) -> None:
    """The list sizes of a raw request body, before validation; 400 ApiError (code `limit_exceeded`)."""
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > limits.max_stop_strings:
        raise _too_many("stop strings", len(stop), limits.max_stop_strings, "stop")
    ids = body.get("stop_token_ids")
    if isinstance(ids, list) and len(ids) > limits.max_stop_token_ids:
        raise _too_many("token ids", len(ids), limits.max_stop_token_ids, "stop_token_ids")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise _too_many("entries", len(bias), limits.max_logit_bias, "logit_bias")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) and len(prompt) > limits.max_prompts:
        raise _too_many("prompts", len(prompt), limits.max_prompts, "prompt")
    check_structured_limits(body, limits)


def check_request_limits(req: CompletionRequest | ChatRequest, limits: RequestLimits) -> None:
    """Raise a 400 ApiError (code `limit_exceeded`) for the first limit `req` exceeds."""
    s = req.sampling
    if len(s.stop) > limits.max_stop_strings:
        raise _too_many("stop strings", len(s.stop), limits.max_stop_strings, "stop")
    longest = max((len(x) for x in s.stop), default=0)
    if longest > limits.max_stop_string_chars:
        raise bad_request(f"'stop' holds a string of {longest} characters; at most {limits.max_stop_string_chars}",
                          param="stop", code="limit_exceeded")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise _too_many("token ids", len(s.stop_token_ids), limits.max_stop_token_ids, "stop_token_ids")
    if len(s.logit_bias) > limits.max_logit_bias:
        raise _too_many("entries", len(s.logit_bias), limits.max_logit_bias, "logit_bias")
    if isinstance(req, CompletionRequest) and len(req.prompts) > limits.max_prompts:
        raise _too_many("prompts", len(req.prompts), limits.max_prompts, "prompt")
