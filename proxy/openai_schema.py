"""Validation of OpenAI request bodies into typed, frozen requests; every rejection is an `ApiError` (4xx).

Checked here: JSON shape, field types (a wrong type is a 400 naming the field), value ranges, the model name
(404 `model_not_found`), parameters the engine cannot honour (400 naming them; a parameter set to its no-op
default, e.g. `best_of: 1` or `tools: []`, is accepted). Unknown fields are ignored. Prompt length and logit_bias
token ids need the tokenizer, so they are checked after tokenization (`resolve_max_tokens`, the app). Body size is
checked by the app. Strings holding a lone UTF-16 surrogate (`"\ud800"`, valid JSON, not valid text) and JSON
nested too deeply are 400s.

Semantics follow vLLM's OpenAI server: `temperature` in [0, 2], `n` samples per prompt, `logprobs` (completions: int
0..20 alternatives; chat: bool + `top_logprobs` 0..20), presence/frequency penalties in [-2, 2],
`repetition_penalty` > 0 (1 = off), `min_tokens`, `logit_bias` ({token id: bias}, clamped to [-100, 100] as vLLM
does), `min_p` in [0, 1] (0 = off), `allowed_token_ids` (a non-empty list; every other token is masked), `bad_words`
(strings; the worker tokenizes them as vLLM does and masks a word's last token after the rest of it), `stop` +
`include_stop_str_in_output`, a list of prompts (all strings or all token-id lists), `echo` (completions: the prompt
before the text, and with `logprobs` its tokens' logprobs, the first one null, as vLLM does; chat: the last
message's content when it has the answer's role), `prompt_logprobs` (vLLM's extra, 0..20, not above 0 when streamed:
every prompt token scored; echo with logprobs, and chat echo, ask for them with the request's own `logprobs` /
`top_logprobs` as vLLM does), `stream_options` (`include_usage`, `continuous_usage_stats`, which only refines
include_usage; `{}` is none), `user` (accepted, unused), `add_special_tokens` (completions: default true; chat:
default none added to the template's text), `return_token_ids` and `return_tokens_as_token_ids` (proxy.responses),
`skip_special_tokens` (default true; false keeps special tokens in the text), `spaces_between_special_tokens`
(accepted, a no-op with the fast tokenizers, as in vLLM). Structured output (`response_format`,
`structured_outputs`, `guided_*`: proxy.structured) and tools (`tools`, `tool_choice`, `parallel_tool_calls`, tool
messages and assistant `tool_calls` in the history: proxy.tools) on chat; structured output on completions too. Chat
rendering as vLLM's: `chat_template_kwargs` (more template variables, e.g. `enable_thinking`),
`add_generation_prompt`, `continue_final_message`. vLLM extras the engine does not implement (`use_beam_search`,
`priority`, `truncate_prompt_tokens`; on chat a per-request `chat_template`, `documents`) are refused unless at
their no-op value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.prompt_logprobs import check_k
from hybridpd.proxy.errors import ApiError, bad_request
from hybridpd.proxy.structured import Structured, parse_structured
from hybridpd.proxy.tools import ToolSpec, history_message, parse_tools

_INT64_MAX = 2**63 - 1
MAX_N = 128
MAX_PROMPTS = 256
MAX_LOGPROBS = 20


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
    top_logprobs: int = 0
    """Alternatives per token (0..20) besides the chosen one; only with `logprobs`."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    """These three, min_p, temperature, top_p, top_k: None when the request leaves them out (the model's generation
    config may then give them: proxy.sampling_defaults; else vLLM's neutral values)."""
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    structured: Structured | None = None
    """(kind, spec) the output must match (engine.structured.spec), compiled by the first worker."""
    min_p: float | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    """None: every token allowed; else non-empty (ids checked against the vocabulary after tokenization)."""
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    """False: special tokens stay in the output text (vLLM's `skip_special_tokens`)."""
    prompt_logprobs: int | None = None
    """vLLM's: score every prompt token with this many alternatives (0..20); None: not asked for."""


@dataclass(frozen=True)
class OutputOptions:
    """vLLM's extras of the response: `return_token_ids` (the prompt's and the output's token ids) and
    `return_tokens_as_token_ids` (logprob tokens written "token_id:<id>")."""

    return_token_ids: bool = False
    tokens_as_ids: bool = False


@dataclass(frozen=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    """`/v1/completions`: one or more prompts, each text or token ids; `n` choices per prompt."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingOptions
    stream: StreamOptions
    cache_salt: str = ""
    n: int = 1
    echo: bool = False
    add_special_tokens: bool = True
    """The tokenizer's special tokens (e.g. a BOS) added to text prompts (vLLM's default for completions)."""
    max_tokens_null: bool = False
    """`"max_tokens": null` given: no limit but the context (vLLM); absent: the endpoint's default (16)."""
    echo_only: bool = False
    """`echo` with `max_tokens: 0` (vLLM's scoring request): the answer is the prompt alone (with its logprobs when
    asked); the worker still samples one token, which is not returned."""
    output: OutputOptions = OutputOptions()


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None
    """The text; content sent as a list of text parts has them joined by newlines (vLLM's string form)."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Tool fields passed to the chat template: an assistant's `tool_calls`, a tool message's `tool_call_id`."""
    parts: tuple[str, ...] | None = None
    """The texts of content sent as a list of text parts (None: sent as a string)."""

    def as_dict(self, content_parts: bool = False) -> dict[str, Any]:
        """What the chat template sees: an assistant's tool-call message without content gets "" (templates
        concatenate `message['content']`). `content_parts` (a template that loops over content): content sent as
        parts stays a list of `{"type": "text", "text": ...}`, as vLLM passes it."""
        content: Any = "" if self.content is None else self.content
        if content_parts and self.parts is not None:
            content = [{"type": "text", "text": t} for t in self.parts]
        return {"role": self.role, "content": content, **dict(self.extra)}


@dataclass(frozen=True)
class ChatRender:
    """How the messages become the prompt (vLLM's chat-rendering fields): `template_kwargs` are more template
    variables (`chat_template_kwargs`, e.g. {"enable_thinking": false}); `continue_final_message` continues the last
    message instead of opening an assistant turn."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class ChatRequest:
    """`/v1/chat/completions`: text-only messages, rendered by the chat template in `proxy.tokenize`."""

    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    stream: StreamOptions
    cache_salt: str = ""
    n: int = 1
    tools: ToolSpec | None = None
    render: ChatRender = ChatRender()
    echo: bool = False
    """vLLM's chat echo: the answer starts with the last message's content when that message has the answer's role
    (the assistant's, or with add_generation_prompt false the last message's own: a continued message)."""
    add_special_tokens: bool | None = None
    """None: the template's text carries its special tokens (none added unless there is no template)."""
    output: OutputOptions = OutputOptions()

    @property
    def echo_text(self) -> str:
        """What the answer's content starts with under `echo` (vLLM's rule): the last message's content when that
        message has the answer's role (the assistant's, or the last message's own without a generation prompt)."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.render.add_generation_prompt else last.role
        return (last.content or "") if last.role == role else ""


def _chat_render(f: _Fields) -> ChatRender:
    """The rendering fields: both add_generation_prompt and continue_final_message true is a 400; continuing a
    message alone opens no new turn (add_generation_prompt false)."""
    add = f.get_bool("add_generation_prompt")
    cont = bool(f.get_bool("continue_final_message"))
    if cont and add:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          param="continue_final_message")
    kwargs = f.get_object("chat_template_kwargs") or {}
    return ChatRender(add_generation_prompt=not cont if add is None else add, continue_final_message=cont,
                      template_kwargs=tuple(kwargs.items()))


def _is_none(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == "" or v == [] or v == {}


# Parameter -> "this value is a no-op default" predicate. Anything else is rejected, naming the parameter.
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "functions": _falsy,
    "function_call": lambda v: v is None or v == "none",
    "audio": _is_none,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _is_none,
    # vLLM sampling extras the engine does not implement (vLLM also refuses a non-zero priority without priority
    # scheduling)
    "use_beam_search": _falsy,
    "priority": lambda v: v is None or v == 0,
    "truncate_prompt_tokens": _is_none,
}
_UNSUPPORTED_COMPLETION = {
    "best_of": lambda v: v is None or v == 1,
    "suffix": _falsy,
    "tools": _falsy,
    "tool_choice": lambda v: v is None or v == "none",
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {  # vLLM's chat-rendering extras: the server's template only
    "chat_template": _is_none,
    "documents": _falsy,
}
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body; malformed JSON, NaN/Infinity or a non-object is a 400."""

    def reject_constant(name: str) -> float:
        raise ValueError(f"non-finite number {name} is not allowed")

    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"could not parse request body as JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise bad_request("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair): "
                          "not valid text", code="invalid_json")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(v: Any) -> bool:
    """Any string (key or value) that cannot be encoded as UTF-8. Iterative: the depth is JSON's own."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


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
            if lo is None:
                bounds = f"<= {hi}"
            else:
                bounds = f">= {lo}" if hi == _INT64_MAX and v < lo else f"in [{lo}, {hi}]"
            raise self._err(name, f"must be {bounds}, got {_short(v)}")
        return v

    def get_float(self, name: str, lo: float | None = None, hi: float | None = None) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._err(name, f"must be a number, got {_json_type(v)}")
        try:
            f = float(v)
        except OverflowError:  # an integer beyond float range
            f = math.inf
        if not math.isfinite(f) or (lo is not None and f < lo) or (hi is not None and f > hi):
            rng = f"in [{lo}, {hi}]" if lo is not None and hi is not None else "finite"
            raise self._err(name, f"must be a number {rng}, got {_short(v)}")
        return f

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


def _short(v: Any) -> str:
    text = str(v) if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
    return text if len(text) <= 40 else text[:37] + "..."


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


def _n(f: _Fields) -> int:
    n = f.get_int("n", lo=1, hi=MAX_N)
    return 1 if n is None else n


def _token_ids(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{name}' must be a list of integers", param=name)
    if any(t < 0 or t > _INT64_MAX for t in v):
        raise bad_request(f"'{name}' holds a negative or too large token id", param=name)
    return tuple(v)


def _allowed_token_ids(v: Any) -> tuple[int, ...] | None:
    """None when absent; an empty list is a 400 (vLLM: "allowed_token_ids is not None and empty")."""
    if v is None:
        return None
    ids = _token_ids(v, "allowed_token_ids")
    if not ids:
        raise bad_request("'allowed_token_ids' must not be empty", param="allowed_token_ids")
    return ids


MAX_BAD_WORDS = 128
"""Token sequences a request's bad_words may become (the engine's limit, vLLM's VLLM_MAX_NUM_BAD_WORDS default)."""


def _bad_words(v: Any) -> tuple[str, ...]:
    """Non-blank strings (a blank one tokenizes to nothing), at most MAX_BAD_WORDS (each becomes one or two token
    sequences, and vLLM refuses more than that many sequences)."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(w, str) and w.strip() for w in v):
        raise bad_request("'bad_words' must be a list of non-blank strings", param="bad_words")
    if len(dict.fromkeys(v)) > MAX_BAD_WORDS:
        raise bad_request(f"'bad_words' holds {len(v)} words, more than {MAX_BAD_WORDS}", param="bad_words")
    return tuple(v)


def _stop(f: _Fields) -> tuple[str, ...]:
    v = f.body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    return tuple(items)


def _logit_bias(f: _Fields) -> tuple[tuple[int, float], ...]:
    v = f.get_object("logit_bias")
    if not v:
        return ()
    out = []
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18):
            raise bad_request(f"'logit_bias' keys must be token ids (non-negative integers), got {key[:40]!r}",
                              param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(f"'logit_bias' values must be numbers, got {_short(bias)} for token {key}",
                              param="logit_bias")
        try:
            value = float(bias)
        except OverflowError:  # an integer beyond float range
            value = math.copysign(math.inf, bias)
        out.append((int(key), min(100.0, max(-100.0, value))))  # clamped, as vLLM does
    return tuple(out)


def _sampling(f: _Fields, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingOptions:
    top_p = f.get_float("top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    temperature = f.get_float("temperature")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    repetition = f.get_float("repetition_penalty")
    if repetition is not None and not 0.0 < repetition <= 100.0:
        raise bad_request(f"'repetition_penalty' must be in (0, 100], got {repetition}", param="repetition_penalty")
    min_tokens = f.get_int("min_tokens", lo=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    stop_ids = f.body.get("stop_token_ids")
    return SamplingOptions(
        min_p=f.get_float("min_p", 0.0, 1.0),
        allowed_token_ids=_allowed_token_ids(f.body.get("allowed_token_ids")),
        bad_words=_bad_words(f.body.get("bad_words")),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=f.get_int("top_k", lo=-1),
        seed=f.get_int("seed", lo=-_INT64_MAX),
        stop=_stop(f),
        stop_token_ids=() if stop_ids is None else _token_ids(stop_ids, "stop_token_ids"),
        ignore_eos=bool(f.get_bool("ignore_eos")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=f.get_float("presence_penalty", -2.0, 2.0),
        frequency_penalty=f.get_float("frequency_penalty", -2.0, 2.0),
        repetition_penalty=repetition,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(f),
        include_stop_str_in_output=bool(f.get_bool("include_stop_str_in_output")),
        structured=parse_structured(f.body),
        skip_special_tokens=f.get_bool("skip_special_tokens") is not False,
    )


def _stream(f: _Fields) -> StreamOptions:
    stream = bool(f.get_bool("stream"))
    opts = f.get_object("stream_options")
    if opts is None or (not opts and not stream):  # vLLM: an empty object is no options
        return StreamOptions(stream=stream)
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    of = _Fields(opts, "stream_options.")
    include, continuous = of.get_bool("include_usage"), of.get_bool("continuous_usage_stats")
    # vLLM: continuous_usage_stats only refines include_usage
    return StreamOptions(stream=True, include_usage=bool(include), continuous_usage_stats=bool(include and continuous))


def _output(f: _Fields) -> OutputOptions:
    return OutputOptions(return_token_ids=bool(f.get_bool("return_token_ids")),
                         tokens_as_ids=bool(f.get_bool("return_tokens_as_token_ids")))


def _cache_salt(f: _Fields) -> str:
    salt = f.get_str("cache_salt")
    if salt == "":
        raise bad_request("'cache_salt' must be a non-empty string when given", param="cache_salt")
    return salt or ""


def _one_prompt(v: Any, name: str) -> str | tuple[int, ...]:
    if isinstance(v, str):
        if not v:
            raise bad_request(f"'{name}' must not be empty", param="prompt")
        return v
    if isinstance(v, list):
        if not v:
            raise bad_request(f"'{name}' must not be empty", param="prompt")
        return _token_ids(v, name)
    raise bad_request(f"'{name}' must be a string or a list of token ids, got {_json_type(v)}", param="prompt")


def _prompts(v: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of token ids, or a list of either (a batch: one or more choices per prompt)."""
    if v is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        if len(v) > MAX_PROMPTS:
            raise bad_request(f"'prompt' holds {len(v)} prompts; at most {MAX_PROMPTS} per request", param="prompt")
        kind = type(v[0])
        odd = next((i for i, p in enumerate(v) if isinstance(p, str | list) and not isinstance(p, kind)), None)
        if odd is not None:  # vLLM's type: a string, token ids, a list of strings or a list of token-id lists
            raise bad_request(f"'prompt' mixes strings and token-id lists (prompt[0] is {_json_type(v[0])}, "
                              f"prompt[{odd}] is {_json_type(v[odd])}): send all strings or all token-id lists",
                              param="prompt")
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(v))
    return (_one_prompt(v, "prompt"),)


def _prompt_logprobs(f: _Fields, derived: int | None) -> int | None:
    """vLLM's `prompt_logprobs`: an integer in [0, 20] (-1, the whole vocabulary, is above the maximum of 20), not
    above 0 with `stream`. Absent: `derived` (what echo asks for)."""
    v = f.body.get("prompt_logprobs")
    if v is None:
        return derived
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'prompt_logprobs' must be an integer, got {_json_type(v)}", param="prompt_logprobs")
    if f.body.get("stream") is True and (v > 0 or v == -1):
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    why = check_k(v, MAX_LOGPROBS, "'prompt_logprobs'")
    if why is not None:
        raise bad_request(why, param="prompt_logprobs")
    return v


def _completion_logprobs(f: _Fields) -> tuple[bool, int]:
    v = f.get_int("logprobs", lo=0, hi=MAX_LOGPROBS)
    return (v is not None, v or 0)


def _chat_logprobs(f: _Fields) -> tuple[bool, int]:
    want = bool(f.get_bool("logprobs"))
    top = f.get_int("top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return want, top or 0


def parse_completion(body: dict[str, Any], served_model: str) -> CompletionRequest:
    """Validate a `/v1/completions` body."""
    f = _Fields(body)
    model = _check_model(f, served_model)
    _check_unsupported(body, {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_COMPLETION})
    n = _n(f)
    logprobs, top = _completion_logprobs(f)
    echo = bool(f.get_bool("echo"))
    prompt_logprobs = _prompt_logprobs(f, top if echo and logprobs else None)  # vLLM: echo scores the prompt
    max_tokens = f.get_int("max_tokens", lo=0 if echo else 1)  # 0: the prompt alone (vLLM's echo without output)
    f.get_str("user")
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * n > MAX_PROMPTS:
        raise bad_request(f"{len(prompts)} prompts x n={n} choices exceeds {MAX_PROMPTS} per request", param="n")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=dataclasses.replace(_sampling(f, 1 if max_tokens == 0 else max_tokens, logprobs, top),
                                     prompt_logprobs=prompt_logprobs),
        stream=_stream(f),
        cache_salt=_cache_salt(f),
        n=n,
        echo=echo,
        add_special_tokens=f.get_bool("add_special_tokens") is not False,
        max_tokens_null="max_tokens" in body and body["max_tokens"] is None,
        echo_only=max_tokens == 0,
        output=_output(f),
    )


def _content(v: Any, where: str) -> tuple[str, tuple[str, ...] | None]:
    """(the text, the parts' texts or None): a list of text parts is joined by newlines, as vLLM does for templates
    that take content as a string (and for chat echo)."""
    if isinstance(v, str):
        return v, None
    if isinstance(v, list):
        parts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{j}]': only text content parts are supported", param=f"{where}[{j}]")
            parts.append(part["text"])
        return "\n".join(parts), tuple(parts)
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
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {sorted(_CHAT_ROLES)}, got {str(role)[:40]!r}",
                              param=f"{where}.role")
        extra = history_message(m, where)
        content = m.get("content")
        if content is None and "tool_calls" in extra:
            out.append(ChatMessage(role=role, content=None, extra=tuple(extra.items())))
            continue
        text, parts = _content(content, f"{where}.content")
        out.append(ChatMessage(role=role, content=text, extra=tuple(extra.items()), parts=parts))
    return tuple(out)


def parse_chat(body: dict[str, Any], served_model: str) -> ChatRequest:
    """Validate a `/v1/chat/completions` body (`max_completion_tokens` wins over the legacy `max_tokens`)."""
    f = _Fields(body)
    model = _check_model(f, served_model)
    _check_unsupported(body, {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_CHAT})
    n = _n(f)
    max_completion = f.get_int("max_completion_tokens", lo=1)
    max_tokens = max_completion if max_completion is not None else f.get_int("max_tokens", lo=1)
    logprobs, top = _chat_logprobs(f)
    echo = bool(f.get_bool("echo"))
    f.get_str("user")
    tools = parse_tools(body)
    sampling = dataclasses.replace(_sampling(f, max_tokens, logprobs, top),
                                   prompt_logprobs=_prompt_logprobs(f, top if echo else None))
    if tools is not None and tools.constrained and sampling.structured is not None:
        raise bad_request("'tool_choice' required or a named function cannot be combined with a structured output "
                          "constraint", param="tool_choice")
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        sampling=sampling,
        stream=_stream(f),
        cache_salt=_cache_salt(f),
        n=n,
        tools=tools,
        render=_chat_render(f),
        echo=echo,
        add_special_tokens=f.get_bool("add_special_tokens"),
        output=_output(f),
    )


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int,
                       min_tokens: int = 0) -> int:
    """Check the prompt fits and return the max_tokens to send (vLLM 0.33's `get_max_tokens`).

    The prompt must leave room for one token, and `requested` must be at most max_model_len, else 400. The result
    is `requested` (not given: `default`; None: no limit) capped at the context the prompt leaves (the answer then
    ends "length" there). `min_tokens` above the result is a 400."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty after tokenization", param="prompt")
    if requested is not None and requested > max_model_len:
        raise bad_request(f"max_tokens={requested} cannot be greater than this model's maximum context length of "
                          f"{max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length is {max_model_len} "
            "tokens (prompt plus at least one generated token)", param="prompt", code="context_length_exceeded")
    wanted = requested if requested is not None else default
    max_tokens = room if wanted is None else min(wanted, room)
    if min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens}: the prompt has "
                          f"{num_prompt_tokens} of the {max_model_len} tokens of context)", param="min_tokens")
    return max_tokens
