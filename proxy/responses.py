"""OpenAI response bodies for completions and chat, whole or as SSE chunks, built from `Delta`s and `Usage`.

One response holds `choices` for every (prompt, sample): choice index = prompt_index * n + sample_index (vLLM's
order). A formatter keeps per-choice state (text offsets, whether the echo was sent).

Logprobs (when asked for):
  completions: `{tokens, token_logprobs, text_offset, top_logprobs}`; `top_logprobs` per token is a dict
               {token text: logprob} of the alternatives the worker returned plus the chosen token. `text_offset`
               is each token's start in the choice's text (echoed prompt included), from decoding the tokens before
               it as the workers do (special tokens add nothing; a character split over tokens starts at its first
               token), never past the end of a whole answer's text (a stop string may cut it): the same whatever
               deltas the workers' output came in (PD sends the first token alone).
  chat:        `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
Tool calls (chat with `tools`, tool_choice not "none"): the text is parsed (proxy.tools): `message.tool_calls`
[{id, type, function: {name, arguments}}] and the text before the first call as `content`; streamed, a call is
one `tool_calls` delta (index, id, type, name and its whole arguments) once it closes. finish_reason "tool_calls"
when the model called a tool (a named tool_choice keeps "stop", as OpenAI does).
Token ids (vLLM's `return_token_ids`): completions give each choice its `prompt_token_ids` (a stream: on the
choice's first chunk); chat gives `prompt_token_ids` on the response (a stream: on its first chunk) and each choice's
`token_ids` (a stream: each chunk's). Completions always carry `token_ids`. With `return_tokens_as_token_ids`,
logprob tokens are written "token_id:<id>" (the text offsets stay the text's).
`stop_reason` (vLLM's): the stop string or stop token id that ended a choice with "stop", else null (EOS, length,
a completed grammar); in a stream, on the choice's last chunk.
Usage: OpenAI's fields plus `hybridpd: {prefill_cached_tokens, transferred_tokens, decode_local_cached_tokens}`.
`prompt_tokens_details.cached_tokens` counts prompt tokens that came from a prefix cache where the prompt was
computed (see `deltas.Usage.local_cached_tokens`), never tokens that merely came over the KV transfer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

from hybridpd.engine.detokenizer import IncrementalDetokenizer
from hybridpd.engine.prompt_logprobs import clamp
from hybridpd.proxy.deltas import Delta, PromptEntry, Usage
from hybridpd.proxy.tools import ToolSpec, ToolStream, parse_output

DONE = "data: [DONE]\n\n"

TokenText = Callable[[int], str]
Decode = Callable[[Sequence[int]], str]


class _Decoder:
    """`Decode` (special tokens skipped) in the shape IncrementalDetokenizer expects."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_dict(usages: Sequence[Usage]) -> dict[str, Any]:
    """Usage of a whole response. `usages`: one per prompt (prompt-side counts) then any further choices (only
    their completion tokens count), as `Choices.usages` orders them."""
    prompt = [u for u in usages if u.counts_prompt]
    completion = sum(u.completion_tokens for u in usages)
    prompt_tokens = sum(u.prompt_tokens for u in prompt)
    transferred = sum(u.external_cached_tokens for u in prompt)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.local_cached_tokens for u in prompt)},
        "hybridpd": {
            "prefill_cached_tokens": sum(u.prefill_cached_tokens for u in prompt),
            "transferred_tokens": transferred,
            "decode_local_cached_tokens": sum(max(0, u.cached_tokens - u.external_cached_tokens) for u in prompt),
        },
    }


def _lp(logprobs: Sequence[float], i: int) -> float | None:
    return float(logprobs[i]) if i < len(logprobs) else None


def prompt_logprob_dicts(entries: Sequence[PromptEntry], token_text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: null for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}}, the prompt token first (its own rank), then the top alternatives (ranks 1, 2, ...; the prompt
    token keeps its place when among them); -inf written -9999.0, as vLLM does."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        row = {str(e.token_id): _logprob_obj(e.logprob, e.rank, token_text(e.token_id))}
        for rank, (t, v) in enumerate(e.top, start=1):
            row[str(t)] = _logprob_obj(v, rank, token_text(t))
        out.append(row)
    return out


def _logprob_obj(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": clamp(float(logprob)), "rank": rank, "decoded_token": text}


def _prompt_entries(deltas: Sequence[Delta]) -> tuple[PromptEntry, ...]:
    """The prompt logprobs a choice's output came with (on its first delta); () when there are none (a one-token
    prompt has no scored token)."""
    return next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), ())


class _Formatter:
    """Shared identity of one response: id, creation time, model, logprob settings, token rendering."""

    object_full = ""
    object_chunk = ""

    def __init__(self, response_id: str, created: int, model: str, token_text: TokenText, logprobs: bool,
                 visible_text: TokenText | None = None, prompt_ids: Sequence[Sequence[int]] | None = None,
                 decoded_token: TokenText | None = None) -> None:
        """`prompt_ids`: per choice, its prompt's token ids, when the response returns token ids (vLLM's
        `return_token_ids`); None otherwise. `decoded_token`: a token's text in `prompt_logprobs` (vLLM writes the
        text there even when `token_text` writes token ids: return_tokens_as_token_ids); default `token_text`."""
        self.response_id = response_id
        self.prompt_ids = prompt_ids
        self.created = created
        self.model = model
        self.token_text = token_text
        self.visible_text = visible_text or token_text  # what a token adds to the output text (specials: "")
        self.decoded_token = decoded_token or token_text
        self.logprobs = logprobs

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _with_usage(self, body: dict[str, Any], usage: dict[str, Any] | None, include: bool) -> dict[str, Any]:
        if include:
            body["usage"] = usage
        return body

    def usage_chunk(self, usages: Sequence[Usage]) -> dict[str, Any]:
        """The extra last chunk of a stream with `stream_options.include_usage`."""
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage_dict(usages)
        return body


class CompletionFormatter(_Formatter):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, *args: Any, echo: Sequence[str] = (), decode: Decode | None = None,
                 echo_ids: Sequence[Sequence[int]] = (), prompt_logprobs: bool = False, top_k: int = 0,
                 echo_only: bool = False, **kwargs: Any) -> None:
        """`echo_ids`: per choice, its prompt's token ids (echo with logprobs); `prompt_logprobs`: the request
        asked for them (each choice gets vLLM's `prompt_logprobs` field); `top_k`: alternatives per token asked;
        `echo_only`: echo with max_tokens 0, the prompt alone (the output token the worker sampled is left out)."""
        super().__init__(*args, **kwargs)
        self._echo_only = echo_only
        self._echo_ids = list(echo_ids)
        self._want_prompt = prompt_logprobs
        self._top_k = top_k
        self._echo = list(echo)  # per choice: the prompt text to put in front (empty: no echo)
        self._echo_sent: set[int] = set()
        self._text_len: dict[int, int] = {}
        self._decode = _Decoder(decode) if decode is not None else None
        self._ids: dict[int, list[int]] = {}  # per choice: output tokens so far (text offsets)
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._start: dict[int, int] = {}  # per choice: where the output starts (after the echo)
        self._prompt_sent: set[int] = set()

    def _offset(self, index: int, tid: int, visible_end: int) -> int:
        """Where token `tid` starts: the choice's decoded output before it (`visible_end`, the sum of the tokens'
        own texts, without a tokenizer to decode with)."""
        if self._decode is None:
            return visible_end
        detok = self._detok.setdefault(index, IncrementalDetokenizer(self._decode))
        ids = self._ids.setdefault(index, [])
        offset = self._start[index] + len(detok.text)
        ids.append(tid)
        detok.update(ids)
        return offset

    def _echo_text(self, index: int) -> str:
        if index in self._echo_sent or index >= len(self._echo):
            return ""
        self._echo_sent.add(index)
        return self._echo[index]

    def _shown_echo(self, prefix: str) -> str:
        """The echo as the choice's text shows it: none when the response returns token ids (vLLM leaves the
        prompt's text out then; the logprobs still lead with the prompt's tokens, offsets as if it were there)."""
        return "" if self.prompt_ids is not None else prefix

    def _logprobs(self, index: int, deltas: Sequence[Delta], prefix: str, whole: bool = False
                  ) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        offsets: list[int] = []
        tops: list[dict[str, float] | None] = []
        if prefix and index < len(self._echo_ids):
            self._echo_logprobs(index, deltas, prefix, (tokens, values, offsets, tops))
        base = self._text_len.get(index, 0) + len(prefix)
        self._start.setdefault(index, base)
        whole_end = base + sum(len(d.text) for d in deltas)  # `deltas` are the whole output: the text's end
        for d in deltas:
            end = whole_end if whole else base + len(d.text)
            offset = base
            for i, tid in enumerate(d.token_ids):
                text = self.token_text(tid)
                lp = _lp(d.logprobs, i)
                tokens.append(text)
                values.append(lp)
                exact = self._offset(index, tid, offset)
                # never past the text's end (a stop string cut it); in a stream, the end is unknown yet
                offsets.append(min(exact, end) if whole or self._decode is None else exact)
                offset += len(self.visible_text(tid))
                alts = d.top_logprobs[i] if i < len(d.top_logprobs) else ()
                top = {self.token_text(t): float(v) for t, v in alts}
                if lp is not None:
                    top.setdefault(text, lp)
                tops.append(top)
            base += len(d.text)
        self._text_len[index] = base
        return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets, "top_logprobs": tops}

    def _echo_logprobs(self, index: int, deltas: Sequence[Delta], prefix: str,
                       into: tuple[list[str], list[float | None], list[int], list[dict[str, float] | None]]) -> None:
        """The echoed prompt's tokens in front of the output's (vLLM's echo with logprobs): the first has no
        logprob (null), each other its prompt logprob and, as vLLM lists them, the first top_k + 1 of {the token,
        then its position's top alternatives}; offsets as the output's, never past the echoed text."""
        tokens, values, offsets, tops = into
        ids = self._echo_ids[index]
        entries = _prompt_entries(deltas)
        start = self._text_len.get(index, 0)
        detok = IncrementalDetokenizer(self._decode) if self._decode is not None else None
        seen: list[int] = []
        offset = start  # the decoded prompt before token i (linear in the prompt: only the new text is measured)
        for i, tid in enumerate(ids):
            tokens.append(self.token_text(tid))
            offsets.append(min(offset, start + len(prefix)))
            seen.append(tid)
            offset += len(detok.update(seen)) if detok is not None else len(self.visible_text(tid))
            e = entries[i - 1] if 0 < i <= len(entries) else None
            if e is None:
                values.append(None)
                tops.append(None)
                continue
            by_id = {e.token_id: e.logprob, **dict(e.top)}
            values.append(clamp(float(e.logprob)))
            tops.append({self.token_text(t): clamp(float(v)) for t, v in islice(by_id.items(), self._top_k + 1)})

    def _shown(self, d: Delta) -> Delta:
        """The delta as the answer shows it: without its output under `echo_only`."""
        if not self._echo_only:
            return d
        return dataclasses.replace(d, token_ids=(), text="", logprobs=(), top_logprobs=())

    def chunk(self, index: int, d: Delta, usage: dict[str, Any] | None, include_usage: bool) -> dict[str, Any]:
        d = self._shown(d)
        prefix = self._echo_text(index)
        choice = {"index": index, "text": self._shown_echo(prefix) + d.text,
                  "logprobs": self._logprobs(index, [d], prefix),
                  "finish_reason": d.finish_reason, "stop_reason": d.stop_reason, "token_ids": list(d.token_ids)}
        if self.prompt_ids is not None and index not in self._prompt_sent:  # on a choice's first chunk
            self._prompt_sent.add(index)
            choice["prompt_token_ids"] = list(self.prompt_ids[index])
        if not self.logprobs:
            self._text_len[index] = self._text_len.get(index, 0) + len(prefix) + len(d.text)
        return self._with_usage(self._envelope(self.object_chunk, [choice]), usage, include_usage)

    def full(self, choices: Sequence[Sequence[Delta]], usages: Sequence[Usage]) -> dict[str, Any]:
        out = []
        for index, shown in enumerate(choices):
            deltas = [self._shown(d) for d in shown]
            prefix = self._echo_text(index)
            out.append({"index": index, "text": self._shown_echo(prefix) + "".join(d.text for d in deltas),
                        "logprobs": self._logprobs(index, deltas, prefix, whole=True),
                        "finish_reason": deltas[-1].finish_reason, "stop_reason": deltas[-1].stop_reason,
                        "token_ids": [t for d in deltas for t in d.token_ids]})  # vLLM-style extra
            if self.prompt_ids is not None:
                out[-1]["prompt_token_ids"] = list(self.prompt_ids[index])
            if self._want_prompt:
                out[-1]["prompt_logprobs"] = prompt_logprob_dicts(_prompt_entries(deltas), self.decoded_token)
        body = self._envelope(self.object_full, out)
        body["usage"] = usage_dict(usages)
        return body


class ChatFormatter(_Formatter):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolSpec | None = None, echo: str = "", prompt_logprobs: bool = False,
                 **kwargs: Any) -> None:
        """`echo`: what every choice's content starts with (vLLM's chat echo); `prompt_logprobs`: the request
        asked for them (the response's `prompt_logprobs` field)."""
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._want_prompt = prompt_logprobs
        self.tools = tools if tools is not None and tools.parses else None
        self._streams: dict[int, ToolStream] = {}

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        if called and reason == "stop" and self.tools is not None and self.tools.choice != "named":
            return "tool_calls"
        return reason

    def _entry(self, tid: int, lp: float | None) -> dict[str, Any]:
        text = self.token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for d in deltas:
            for i, tid in enumerate(d.token_ids):
                entry = self._entry(tid, _lp(d.logprobs, i))
                alts = d.top_logprobs[i] if i < len(d.top_logprobs) else ()
                entry["top_logprobs"] = [self._entry(t, float(v)) for t, v in alts]
                content.append(entry)
        return {"content": content}

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        """First chunk of a choice's stream: the assistant role, empty content."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None, "stop_reason": None}
        body = self._envelope(self.object_chunk, [choice])
        if self.prompt_ids is not None and index == 0:  # the stream's first chunk (vLLM)
            body["prompt_token_ids"] = list(self.prompt_ids[0])
        return self._with_usage(body, None, include_usage)

    def echo_chunk(self, index: int, include_usage: bool) -> dict[str, Any] | None:
        """After the role chunks of a stream, each choice's echo as its own content chunk (vLLM); None: no echo."""
        if not self.echo:
            return None
        choice = {"index": index, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}
        return self._with_usage(self._envelope(self.object_chunk, [choice]), None, include_usage)

    def chunk(self, index: int, d: Delta, usage: dict[str, Any] | None, include_usage: bool) -> dict[str, Any]:
        if self.tools is None:
            delta: dict[str, Any] = {"content": d.text} if d.text or not d.finish_reason else {}
            finish = d.finish_reason
        else:
            stream = self._streams.setdefault(index, ToolStream(self.tools))
            content, calls = stream.feed(d.text, final=d.finish_reason is not None)
            delta = {"content": content} if content or not (d.finish_reason or calls) else {}
            if calls:
                delta["tool_calls"] = calls
            finish = self._finish_reason(d.finish_reason, stream.num_calls > 0)
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs([d]), "finish_reason": finish,
                  "stop_reason": d.stop_reason}
        if self.prompt_ids is not None:
            choice["token_ids"] = list(d.token_ids)
        return self._with_usage(self._envelope(self.object_chunk, [choice]), usage, include_usage)

    def full(self, choices: Sequence[Sequence[Delta]], usages: Sequence[Usage]) -> dict[str, Any]:
        out = []
        for index, deltas in enumerate(choices):
            text = "".join(d.text for d in deltas)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = deltas[-1].finish_reason
            if self.tools is not None:
                message["content"], calls = parse_output(text, self.tools)
                message["tool_calls"] = calls
                finish = self._finish_reason(finish, bool(calls))
            if self.echo:  # vLLM puts the echo in front of whatever content the answer has
                message["content"] = self.echo + (message["content"] or "")
            out.append({"index": index, "message": message, "logprobs": self._logprobs(deltas),
                        "finish_reason": finish, "stop_reason": deltas[-1].stop_reason})
            if self.prompt_ids is not None:
                out[-1]["token_ids"] = [t for d in deltas for t in d.token_ids]
        body = self._envelope(self.object_full, out)
        if self._want_prompt:  # one prompt: its choices' prompt logprobs are the same
            body["prompt_logprobs"] = prompt_logprob_dicts(_prompt_entries(choices[0]), self.decoded_token)
        if self.prompt_ids is not None:
            body["prompt_token_ids"] = list(self.prompt_ids[0])
        body["usage"] = usage_dict(usages)
        return body
