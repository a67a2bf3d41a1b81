"""Per-request sampling parameters (the `SamplingParams` contract of DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. `stop` strings end generation when they appear in
    the decoded output (the text is cut before the stop string); `stop_token_ids` end it when sampled (the token is
    kept). EOS ends generation unless `ignore_eos`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
