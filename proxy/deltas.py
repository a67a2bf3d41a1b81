"""A request's forms on the wire between the proxy and its workers: the validated request (`PreparedRequest`) as
the workers' `SamplingParams`, each worker `GenerateChunk` as the client-facing `Delta` (tokens, text, logprobs,
the stop reason, prompt logprobs), P's first token as Generate carries it to D, and a request's token counts
(`Usage`). Plain data and conversions: the trip itself is proxy/generation.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hybridpd.proto import hybridpd_pb2 as pb
from hybridpd.proxy.openai_schema import SamplingOptions


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for the workers (`max_tokens` already resolved)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    cache_salt: str = ""
    counts_prompt: bool = True
    """False for the 2nd..nth sample of a prompt: usage counts its prompt once."""


@dataclass(frozen=True)
class Delta:
    """New output since the previous delta; `finish_reason` is set on the last one."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: str | None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per token, the worker's most likely (token id, logprob) alternatives, when asked for and sent."""
    stop_reason: str | int | None = None
    """vLLM's stop_reason, on the last delta: the stop string or stop token id that ended the request."""
    prompt_logprobs: tuple[PromptEntry, ...] | None = None
    """On the first delta of a request that asked for prompt logprobs: one entry per prompt token after the first."""


class PromptEntry(NamedTuple):
    """One scored prompt token (GenerateChunk.prompt_logprobs): its logprob, rank and the top (token id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass
class Usage:
    """Token counts of one request. `cached_tokens` is D's `num_cached_tokens`: prompt tokens D did not compute
    (its local prefix hit plus tokens pulled from P); `external_cached_tokens` is the pulled part;
    `prefill_cached_tokens` is P's own prefix hit (0 when colocated). `counts_prompt` is False for the 2nd..nth
    sample of a prompt (its prompt is counted once)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    external_cached_tokens: int = 0
    prefill_cached_tokens: int = 0
    counts_prompt: bool = True

    @property
    def local_cached_tokens(self) -> int:
        """Prompt tokens found in a prefix cache where the prompt was computed (OpenAI's `cached_tokens`): P's hit
        when D took the KV over the transfer, else D's own hit. Transferred tokens are not a cache hit."""
        if self.external_cached_tokens > 0:
            return self.prefill_cached_tokens
        return self.cached_tokens


def to_proto_sampling(s: SamplingOptions) -> pb.SamplingParams:
    if s.max_tokens is None:
        raise ValueError("max_tokens must be resolved before the request reaches a worker")
    msg = pb.SamplingParams(
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias),
        include_stop_str_in_output=s.include_stop_str_in_output,
        min_p=s.min_p or 0.0,
        allowed_token_ids=list(s.allowed_token_ids or ()),
        bad_words=list(s.bad_words),
    )
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
        msg.repetition_penalty = s.repetition_penalty
    if not s.skip_special_tokens:
        msg.skip_special_tokens = False
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(s, name)
        if value is not None:
            setattr(msg, name, value)
    if s.structured is not None:
        msg.structured_output.kind, msg.structured_output.spec = s.structured
    return msg


def top_logprobs_of(chunk: pb.GenerateChunk) -> tuple[tuple[tuple[int, float], ...], ...]:
    """`GenerateChunk.top_logprobs` (one entry per token: token_ids + logprobs) as the proxy's tuples."""
    return tuple(tuple(zip(e.token_ids, e.logprobs, strict=False)) for e in chunk.top_logprobs)


def prompt_logprobs_of(chunk: pb.GenerateChunk) -> tuple[PromptEntry, ...] | None:
    """`GenerateChunk.prompt_logprobs` as the proxy's entries; None when the chunk has none."""
    if not chunk.prompt_logprobs:
        return None
    return tuple(
        PromptEntry(e.token_id, e.logprob, e.rank, tuple(zip(e.top.token_ids, e.top.logprobs, strict=False)))
        for e in chunk.prompt_logprobs
    )


def stop_reason_of(chunk: pb.GenerateChunk) -> str | int | None:
    """The chunk's stop string or stop token id (what ended the request with "stop"), else None."""
    if chunk.stop_string:
        return chunk.stop_string
    return chunk.stop_token_id if chunk.HasField("stop_token_id") else None


def first_token_of(chunk: pb.GenerateChunk) -> pb.FirstToken:
    """The first token of P's `first` chunk, as Generate carries it to D."""
    first = pb.FirstToken(token_id=chunk.token_ids[0], logprob=chunk.logprobs[0] if chunk.logprobs else 0.0)
    if chunk.top_logprobs:
        first.top_logprobs.CopyFrom(chunk.top_logprobs[0])
    return first
