"""OpenAI response bodies for completions and chat, whole or as SSE chunks, built from `Delta`s and `Usage`.

Logprobs are the chosen token's only (the workers return no alternatives):
  completions: `logprobs: {tokens, token_logprobs, text_offset, top_logprobs: null}`; `text_offset` counts
               characters of the token texts emitted so far (an approximation where D cut a stop string);
  chat:        `logprobs: {content: [{token, logprob, bytes, top_logprobs: []}]}`.
Usage: OpenAI's fields plus `hybridpd: {prefill_cached_tokens, transferred_tokens, decode_local_cached_tokens}`.
`prompt_tokens_details.cached_tokens` is the decode worker's num_cached_tokens (local prefix hit + transferred).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from proxy.generation import Delta, Usage

DONE = "data: [DONE]\n\n"

TokenText = Callable[[int], str]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "hybridpd": {
            "prefill_cached_tokens": u.prefill_cached_tokens,
            "transferred_tokens": u.external_cached_tokens,
            "decode_local_cached_tokens": max(0, u.cached_tokens - u.external_cached_tokens),
        },
    }


def _lp(logprobs: Sequence[float], i: int) -> float | None:
    return float(logprobs[i]) if i < len(logprobs) else None


class _Formatter:
    """Shared identity of one response: id, creation time, model, logprob settings."""

    object_full = ""
    object_chunk = ""

    def __init__(self, response_id: str, created: int, model: str, token_text: TokenText, logprobs: bool) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.logprobs = logprobs

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The extra last chunk of a stream with `stream_options.include_usage`."""
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage_dict(usage)
        return body


class CompletionFormatter(_Formatter):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offset = 0

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        offsets: list[int] = []
        for d in deltas:
            for i, tid in enumerate(d.token_ids):
                text = self.token_text(tid)
                tokens.append(text)
                values.append(_lp(d.logprobs, i))
                offsets.append(self._offset)
                self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets, "top_logprobs": None}

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        choice = {"index": 0, "text": d.text, "logprobs": self._logprobs([d]), "finish_reason": d.finish_reason,
                  "token_ids": list(d.token_ids)}
        body = self._envelope(self.object_chunk, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def full(self, deltas: Sequence[Delta], usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "text": "".join(d.text for d in deltas), "logprobs": self._logprobs(deltas),
                  "finish_reason": deltas[-1].finish_reason,
                  "token_ids": [t for d in deltas for t in d.token_ids]}  # vLLM-style extra: generated token ids
        body = self._envelope(self.object_full, [choice])
        body["usage"] = usage_dict(usage)
        return body


class ChatFormatter(_Formatter):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for d in deltas:
            for i, tid in enumerate(d.token_ids):
                text = self.token_text(tid)
                content.append({"token": text, "logprob": _lp(d.logprobs, i), "bytes": list(text.encode("utf-8")),
                                "top_logprobs": []})
        return {"content": content}

    def role_chunk(self, include_usage: bool) -> dict[str, Any]:
        """First chunk of a stream: the assistant role, empty content."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        body = self._envelope(self.object_chunk, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        delta = {"content": d.text} if d.text or not d.finish_reason else {}
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs([d]), "finish_reason": d.finish_reason}
        body = self._envelope(self.object_chunk, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def full(self, deltas: Sequence[Delta], usage: Usage) -> dict[str, Any]:
        message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(deltas),
                  "finish_reason": deltas[-1].finish_reason}
        body = self._envelope(self.object_full, [choice])
        body["usage"] = usage_dict(usage)
        return body
