"""Per-request sampling parameters (a public contract)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.prompt_logprobs import check_k
from hybridpd.engine.structured.spec import StructuredOutput

MAX_LOGPROBS = 20
"""Most alternatives per position for `top_logprobs` and `prompt_logprobs` (vLLM's max_logprobs default)."""
MAX_BAD_WORDS = 128
"""Token sequences `bad_words` may become (vLLM's VLLM_MAX_NUM_BAD_WORDS default)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. `stop` strings end generation when they appear in
    the decoded output (the text is cut before the stop string, or after it with `include_stop_str_in_output`);
    `stop_token_ids` end it when sampled (the token is kept). EOS ends generation unless `ignore_eos`.

    vLLM semantics for the rest: `presence_penalty` / `frequency_penalty` (subtracted from the logits of tokens the
    output already holds, once / per occurrence), `repetition_penalty` (logits of tokens in the prompt or output
    divided by it when positive, multiplied when negative; 1 = off), `min_tokens` (EOS and stop_token_ids masked,
    stop strings not checked, until that many tokens), `logit_bias` ({token id: bias} added to the logits),
    `logprobs` (return the chosen token's logprob; always computed) with `top_logprobs` alternatives per step,
    `prompt_logprobs` (every prompt token scored, with that many alternatives).
    Penalties and biases shape sampling; the returned logprobs are those of the raw model distribution.

    `min_p` in [0, 1] (0 = off): after temperature, tokens whose probability is below min_p x the most likely
    token's are dropped, before top-k and top-p (vLLM's order); greedy rows ignore it. `allowed_token_ids`: a
    non-empty list of token ids; every other token is masked before sampling, greedy rows included (ids are
    checked against the vocabulary when the engine takes the request). `bad_words` (vLLM's rule): the engine
    tokenizes each word, and the word with a leading space when that is a different token sequence of the same
    length (`bad_words_token_ids`, set by the engine); a word's last token is masked whenever the output ends with
    the rest of the word (a one-token word is never sampled).

    `structured_output` (engine.structured): the output must match a JSON schema, regex, choice, grammar or a
    tool-call format; tokens the grammar does not allow next are masked, and generation stops when the grammar is
    complete. Also accepted as a dict `{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ...}`,
    `{"json_object": True}` (vLLM's StructuredOutputsParams fields)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    """Given as a dict (vLLM) or pairs; stored as sorted (token id, bias) pairs (hashable)."""
    include_stop_str_in_output: bool = False
    top_logprobs: int = 0
    structured_output: StructuredOutput | Mapping[str, object] | None = None
    min_p: float = 0.0
    allowed_token_ids: Sequence[int] | None = None
    """Stored as a tuple (hashable); None: every token allowed."""
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True
    """vLLM's: special tokens are left out of the text (false: kept, and stop strings see them)."""
    prompt_logprobs: int | None = None
    """vLLM's: score every prompt token (its logprob, rank and the top `prompt_logprobs` alternatives at its
    position; 0..MAX_LOGPROBS); `RequestOutput.prompt_logprobs`. A request that asks reads no prefix cache."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False)
    """`bad_words` tokenized (`with_bad_words_token_ids`, by the engine that takes the request); what the sampler
    reads."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "structured_output", _structured(self.structured_output))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        words = self.bad_words
        words = (words,) if isinstance(words, str) else tuple(dict.fromkeys(words or ()))  # vLLM dedups
        object.__setattr__(self, "bad_words", words)
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (str, bytes)):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bias = self.logit_bias or ()
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in pairs)) or None)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise bad(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {v!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 100.0:
            raise bad(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or \
                not 0 <= self.top_logprobs <= 20:
            raise bad(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (why := check_k(self.prompt_logprobs, MAX_LOGPROBS)) is not None:
            raise bad(why)
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids:
                raise bad(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise bad(f"allowed_token_ids must be non-negative integers, got {t!r}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                raise bad(f"bad_words must be non-empty strings, got {w!r}")
        for t, b in self.logit_bias or ():  # type: ignore[misc]
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad(f"logit_bias keys must be token ids, got {t!r}")
            if not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                raise bad(f"logit_bias values must be in [-100, 100], got {b!r}")

    def with_bad_words_token_ids(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """A copy holding `bad_words` tokenized as vLLM's `update_from_tokenizer` does: each word (left-stripped),
        then with a leading space when that gives a different first token and as many tokens (the word inside the
        text). Raises InvalidRequestError for a word that tokenizes to nothing or more than MAX_BAD_WORDS sequences."""
        ids: list[tuple[int, ...]] = []
        for word in self.bad_words:
            for prefix in ("", " "):
                seq = tuple(encode(prefix + word.lstrip()))
                if not seq:
                    if not prefix:
                        raise InvalidRequestError(f"invalid sampling parameter: bad_words entry {word!r} tokenizes "
                                                  "to no token")
                    continue
                if not prefix or (seq[0] != ids[-1][0] and len(seq) == len(ids[-1])):
                    ids.append(seq)
        if len(ids) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"invalid sampling parameter: too many bad words after tokenization: "
                                      f"{len(ids)} (at most {MAX_BAD_WORDS})")
        out = copy.copy(self)
        object.__setattr__(out, "bad_words_token_ids", tuple(ids))
        return out

    @property
    def structured(self) -> StructuredOutput | None:
        return self.structured_output  # type: ignore[return-value]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0



def _structured(v: object) -> StructuredOutput | None:
    """A StructuredOutput from itself or from vLLM's dict spelling (exactly one of json / regex / choice /
    grammar / json_object)."""
    import json

    if v is None or isinstance(v, StructuredOutput):
        return v
    if not isinstance(v, Mapping):
        raise InvalidRequestError(f"invalid sampling parameter: structured_output must be a StructuredOutput or a "
                                  f"dict, got {type(v).__name__}")
    given = {k: x for k, x in v.items() if x is not None and x is not False}
    if len(given) != 1:
        raise InvalidRequestError("invalid sampling parameter: structured_output needs exactly one of json, regex, "
                                  f"choice, grammar, json_object; got {sorted(given)}")
    (kind, value), = given.items()
    if kind == "json":
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(value) if isinstance(value, list | tuple) else value))
    if kind == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(str(kind), value if isinstance(value, str) else json.dumps(value))
