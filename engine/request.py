"""A request as the scheduler and cache managers see it: ids and counts, no tensors.

Prefill vs decode is derived, not a code path: a request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (how many of those are in the caches). Each step computes some of the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hybridpd.engine.prompt_logprobs import Logprob, PromptLogprobs
from hybridpd.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_TRANSFER = "waiting_for_transfer"
    """Holds destination pages while its first tokens are transferred in (engine/transfer.py); never scheduled."""
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int = 0
    cache_salt: str | None = None
    compute_target: int | None = None
    """Stop once this many tokens are computed, without sampling (finish "prefilled", caches kept)."""
    prefill_only: bool = False
    """A prefill worker's request: compute the prompt, sample the first output token exactly as a colocated engine
    would, then finish "prefilled" with its caches kept (for a consumer to continue from that token), unless the
    token already ends the request (then it finishes as any request does)."""
    external_computed_tokens: int = 0
    """Tokens whose KV/state arrive by transfer (consumer side); set by the decode worker before scheduling."""
    held_from: int | None = None
    """Output tokens from this index on are held back: the request runs on transferred caches the producer has not
    confirmed yet (engine/transfer.py `run_unconfirmed`). They are not streamed, and dropped if it refuses."""
    held_finish: str | None = None
    """The end ("stop", "length") the request reached while held back; it ends so once confirmed."""
    prompt_logprobs: PromptLogprobs | None = None
    """Scores of the prompt positions computed so far, when the request asks for prompt logprobs (the runner's
    rows, engine.prompt_logprobs); complete once the first output token is sampled."""

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per generated token, the `top_logprobs` most likely (token id, logprob) when the request asked for them."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prefix-cache hit (tokens) found when first scheduled; -1 until then."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_text_end: int | None = None
    """Where the output text ends when a stop string ended the request: the end of the match check_stop found
    (occurrences before min_tokens are ordinary text); the text is cut before the match unless
    include_stop_str_in_output."""
    detokenizer: Any = None
    """hybridpd.engine.detokenizer.IncrementalDetokenizer of the output, made on first use (EngineCore._decoded)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hash of every *full* block of all_token_ids (see engine.cache.hashing)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # decode: slice the outputs, do not copy the whole sequence
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def target_tokens(self) -> int:
        """Tokens to have computed before the next sample (or before a prefill-only request is done)."""
        return self.compute_target if self.compute_target is not None else self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt (a public contract)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    num_cached_tokens: int
    finish_reason: str | None
    num_preemptions: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """vLLM's shape when SamplingParams.prompt_logprobs is set: None for the first prompt token, then per prompt
    token {token id: Logprob} (the token itself and the top k); None when not asked for."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
