"""Validation of OpenAI request bodies into typed, frozen requests; every rejection is an `ApiError` (4xx).

Checked here: JSON shape, field types (a wrong type is a 400 naming the field), value ranges, the model name
(404 `model_not_found`), parameters the engine cannot honour (400 naming them; a parameter set to its no-op
default, e.g. `best_of: 1` or `presence_penalty: 0`, is accepted). Unknown fields are ignored. Prompt length
checks need token counts, so they run after tokenization (`resolve_max_tokens`). Body size is checked by the app.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.errors import ApiError, bad_request

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling fields common to both endpoints; `max_tokens=None` means "use the endpoint default"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False


@dataclass(frozen=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    """`/v1/completions`: the prompt is text or token ids (a batch of one is unwrapped)."""

    model: str
    prompt: str | tuple[int, ...]
    sampling: SamplingOptions
    stream: StreamOptions
    cache_salt: str = ""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    """`/v1/chat/completions`: text-only messages, rendered by the chat template in `proxy.tokenize`."""

    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    stream: StreamOptions
    cache_salt: str = ""


def _is_none(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == "" or v == [] or v == {}


# Parameter -> "this value is a no-op default" predicate. Anything else is rejected, naming the parameter.
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _falsy,
    "presence_penalty": _falsy,
    "frequency_penalty": _falsy,
    "repetition_penalty": lambda v: v is None or v == 1,
    "min_tokens": _falsy,
    "prompt_logprobs": _is_none,
    "tools": _falsy,
    "functions": _falsy,
    "function_call": lambda v: v is None or v == "none",
    "tool_choice": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
    "guided_json": _is_none,
    "guided_regex": _is_none,
    "guided_choice": _is_none,
    "guided_grammar": _is_none,
    "structured_outputs": _is_none,
    "audio": _is_none,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _is_none,
}
_UNSUPPORTED_COMPLETION = {
    "best_of": lambda v: v is None or v == 1,
    "echo": _falsy,
    "suffix": _falsy,
}
_UNSUPPORTED_CHAT = {
    "top_logprobs": _falsy,
}
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body; malformed JSON, NaN/Infinity or a non-object is a 400."""

    def reject_constant(name: str) -> float:
        raise ValueError(f"non-finite number {name} is not allowed")

    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"could not parse request body as JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


class _Fields:
    """Typed getters over a raw JSON object; each raises a 400 naming the field on a wrong type or range."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def _err(self, name: str, message: str) -> ApiError:
        return bad_request(f"'{self.prefix}{name}' {message}", param=f"{self.prefix}{name}")

    def get_int(self, name: str, lo: int | None = None, hi: int = _INT64_MAX) -> int | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(name, f"must be an integer, got {_json_type(v)}")
        if (lo is not None and v < lo) or v > hi:
            bounds = f">= {lo}" if hi == _INT64_MAX else f"in [{lo}, {hi}]"
            raise self._err(name, f"must be {bounds}, got {v}")
        return v

    def get_float(self, name: str) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self._err(name, f"must be a number, got {_json_type(v)}")
        return float(v)

    def get_bool(self, name: str) -> bool | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, bool):
            raise self._err(name, f"must be a boolean, got {_json_type(v)}")
        return v

    def get_str(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, str):
            raise self._err(name, f"must be a string, got {_json_type(v)}")
        return v

    def get_object(self, name: str) -> dict[str, Any] | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, dict):
            raise self._err(name, f"must be an object, got {_json_type(v)}")
        return v


def _json_type(v: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def _check_unsupported(body: dict[str, Any], table: dict[str, Callable[[Any], bool]]) -> None:
    bad = sorted(name for name, is_default in table.items() if name in body and not is_default(body[name]))
    if bad:
        names = ", ".join(f"'{n}'" for n in bad)
        raise bad_request(f"unsupported parameter(s): {names}", param=bad[0], code="unsupported_parameter")


def _check_model(f: _Fields, served: str) -> str:
    model = f.get_str("model")
    if model is None:
        return served
    if model != served:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")
    return model


def _check_n(f: _Fields) -> None:
    n = f.get_int("n", lo=1)
    if n is not None and n > 1:
        raise bad_request("'n' > 1 is not supported", param="n", code="unsupported_parameter")


def _token_ids(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{name}' must be a list of integers", param=name)
    if any(t < 0 or t > _INT64_MAX for t in v):
        raise bad_request(f"'{name}' holds a negative or too large token id", param=name)
    return tuple(v)


def _stop(f: _Fields) -> tuple[str, ...]:
    v = f.body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    return tuple(items)


def _sampling(f: _Fields, max_tokens: int | None, logprobs: bool) -> SamplingOptions:
    top_p = f.get_float("top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    temperature = f.get_float("temperature")
    if temperature is not None and temperature < 0.0:
        raise bad_request(f"'temperature' must be >= 0, got {temperature}", param="temperature")
    stop_ids = f.body.get("stop_token_ids")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=f.get_int("top_k", lo=-1),
        seed=f.get_int("seed", lo=-_INT64_MAX),
        stop=_stop(f),
        stop_token_ids=() if stop_ids is None else _token_ids(stop_ids, "stop_token_ids"),
        ignore_eos=bool(f.get_bool("ignore_eos")),
        logprobs=logprobs,
    )


def _stream(f: _Fields) -> StreamOptions:
    stream = bool(f.get_bool("stream"))
    opts = f.get_object("stream_options")
    if opts is None:
        return StreamOptions(stream=stream)
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include = _Fields(opts, "stream_options.").get_bool("include_usage")
    return StreamOptions(stream=True, include_usage=bool(include))


def _cache_salt(f: _Fields) -> str:
    salt = f.get_str("cache_salt")
    if salt == "":
        raise bad_request("'cache_salt' must be a non-empty string when given", param="cache_salt")
    return salt or ""


def _prompt(v: Any) -> str | tuple[int, ...]:
    if v is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        if len(v) != 1:
            raise bad_request("batched prompts are not supported: send one prompt per request", param="prompt",
                              code="unsupported_parameter")
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return v
    if isinstance(v, list):
        if not v:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return _token_ids(v, "prompt")
    raise bad_request(f"'prompt' must be a string or a list of token ids, got {_json_type(v)}", param="prompt")


def parse_completion(body: dict[str, Any], served_model: str) -> CompletionRequest:
    """Validate a `/v1/completions` body."""
    f = _Fields(body)
    model = _check_model(f, served_model)
    _check_unsupported(body, {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_COMPLETION})
    _check_n(f)
    logprobs = f.get_int("logprobs", lo=0, hi=20)
    return CompletionRequest(
        model=model,
        prompt=_prompt(body.get("prompt")),
        sampling=_sampling(f, f.get_int("max_tokens", lo=1), logprobs is not None),
        stream=_stream(f),
        cache_salt=_cache_salt(f),
    )


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{j}]': only text content parts are supported", param=f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'{where}' must be a string or a list of text parts, got {_json_type(v)}", param=where)


def _messages(v: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(v, list) or not v:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {sorted(_CHAT_ROLES)}, got {role!r}",
                              param=f"{where}.role")
        if m.get("tool_calls"):
            raise bad_request(f"'{where}.tool_calls' is not supported", param=f"{where}.tool_calls",
                              code="unsupported_parameter")
        out.append(ChatMessage(role=role, content=_content(m.get("content"), f"{where}.content")))
    return tuple(out)


def parse_chat(body: dict[str, Any], served_model: str) -> ChatRequest:
    """Validate a `/v1/chat/completions` body (`max_completion_tokens` wins over the legacy `max_tokens`)."""
    f = _Fields(body)
    model = _check_model(f, served_model)
    _check_unsupported(body, {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_CHAT})
    _check_n(f)
    max_completion = f.get_int("max_completion_tokens", lo=1)
    max_tokens = max_completion if max_completion is not None else f.get_int("max_tokens", lo=1)
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        sampling=_sampling(f, max_tokens, bool(f.get_bool("logprobs"))),
        stream=_stream(f),
        cache_salt=_cache_salt(f),
    )


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """Check the prompt fits and return the max_tokens to send.

    `requested` explicit: prompt + requested must fit in max_model_len, else 400. Not given: `default` capped at
    the remaining context (`default=None` means "all the remaining context")."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty after tokenization", param="prompt")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length is {max_model_len} "
            "tokens (prompt plus at least one generated token)", param="prompt", code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {requested}; together they exceed this "
            f"model's maximum context length of {max_model_len} tokens", param="max_tokens",
            code="context_length_exceeded")
    return requested
