"""Per-request grammar state and the per-step token bitmask.

Ownership: the engine's step thread. One xgrammar GrammarMatcher per constrained request, created when the request
first samples (on a decode worker under PD, that is its first token) and advanced with every token the engine
accepts (`accept`). The matcher counts the tokens it has accepted; when that count is not the request's number of
output tokens (a recompute that dropped output, say) it is rebuilt by replaying the output, so the grammar state
always equals "the output so far".

Per step (`apply`, called by the sampler on its logits): one int32 bitmask [rows, ceil(vocab / 32)] in host memory
(pinned on CUDA, reused), filled for the constrained rows by their matchers (xgrammar's C++, about a microsecond
a row; its BatchGrammarMatcher's helper threads cost more CPU than they save at these sizes), copied
to the device in one transfer and applied in place by xgrammar's kernel to those rows; unconstrained rows are left
alone. JSON rows also lose tokens holding raw control characters (GrammarCache.json_allowed). No per-row device
work and no host sync beyond the sampler's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.structured.spec import StructuredOutput

log = logging.getLogger("hybridpd.structured")
_JSON_KINDS = frozenset({"json", "json_object"})


class _Output(Protocol):
    request_id: str
    output_token_ids: list[int]


@dataclass
class _State:
    matcher: Any
    accepted: int = 0
    """Output tokens the matcher has consumed."""
    rejected: bool = False


class StructuredOutputs:
    """The engine's structured-output state: a compiled-grammar cache and one matcher per constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 lookup: Callable[[str], _Output | None]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lookup = lookup
        self._grammars: Any = None
        self._states: dict[str, _State] = {}
        self._bitmask: torch.Tensor | None = None
        self._stop_row: torch.Tensor | None = None

    @property
    def grammars(self) -> Any:
        """The GrammarCache, built on first use (xgrammar is imported only when a request asks for structure)."""
        if self._grammars is None:
            if self._tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer and this worker has none")
            from hybridpd.engine.structured.grammar import GrammarCache, tokenizer_info

            info = tokenizer_info(self._tokenizer.backend, self.vocab_size, self.eos_token_ids)
            self._grammars = GrammarCache(info)
        return self._grammars

    def check(self, spec: StructuredOutput) -> None:
        """Compile (or find cached) `spec`; InvalidRequestError naming the problem when it is malformed."""
        self.grammars.get(spec)

    # -- per request ---------------------------------------------------------------------------------------------
    def _state(self, rid: str, spec: StructuredOutput) -> _State:
        req = self._lookup(rid)
        output = req.output_token_ids if req is not None else []
        st = self._states.get(rid)
        if st is not None and st.accepted == len(output):
            return st
        import xgrammar as xgr

        st = _State(xgr.GrammarMatcher(self.grammars.get(spec)))
        for tok in output:  # a new matcher, or a rebuilt one after the output changed under it
            if not st.matcher.accept_token(tok):
                st.rejected = True
                log.warning("request %s: output token %d does not match its grammar", rid, tok)
                break
            st.accepted += 1
        self._states[rid] = st
        return st

    def accept(self, req: _Output) -> bool:
        """Advance `req`'s matcher by its newest token. False when the output is complete (the grammar reached its
        end) or the token broke it: the request should stop."""
        st = self._states.get(req.request_id)
        if st is None:
            return True
        if st.accepted != len(req.output_token_ids) - 1:  # out of step: rebuilt at the next `apply`
            return True
        ok = st.matcher.accept_token(req.output_token_ids[-1])
        st.accepted += 1
        if not ok:
            st.rejected = True
            log.warning("request %s: sampled token %d does not match its grammar", req.request_id,
                        req.output_token_ids[-1])
        return ok and not st.matcher.is_terminated()

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # -- per step ------------------------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, rids: Sequence[str], params: Sequence[SamplingParams]) -> None:
        """Mask, in place, every token a constrained row's grammar does not allow next."""
        rows = [i for i, p in enumerate(params) if p.structured_output is not None]
        if not rows:
            return
        import xgrammar as xgr

        matchers = [self._state(rids[i], params[i].structured_output).matcher for i in rows]  # type: ignore[arg-type]
        bitmask = self._host_bitmask(len(params), logits.device)
        for row, matcher in zip(rows, matchers, strict=True):  # xgrammar fills a row in C++; no helper threads
            if matcher.is_terminated():  # complete (its request ends this step): only a stop token may follow
                bitmask[row] = self._stop_only()
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
        json_rows = [i for i in rows if params[i].structured_output.kind in _JSON_KINDS]  # type: ignore[union-attr]
        if json_rows:
            bitmask[json_rows] &= self.grammars.json_allowed
        device_mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, device_mask[: len(params)], indices=rows)

    def _stop_only(self) -> torch.Tensor:
        if self._stop_row is None:
            allowed = torch.zeros(-(-self.vocab_size // 32) * 32, dtype=torch.int64)
            allowed[[t for t in self.eos_token_ids if t < self.vocab_size]] = 1
            words = (allowed.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
            self._stop_row = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return self._stop_row

    def _host_bitmask(self, rows: int, device: torch.device) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            cap = max(rows, 64 if self._bitmask is None else 2 * self._bitmask.shape[0])
            mask = xgr.allocate_token_bitmask(cap, self.vocab_size)
            self._bitmask = mask.pin_memory() if device.type == "cuda" else mask
        return self._bitmask[:rows]


__all__ = ["StructuredOutputs"]
