"""Batched sampling from float32 logits, one call per step for every row that needs a token.

    raw logits --log_softmax--> logprobs returned (chosen token + top-k alternatives), as `transformers` reports
         |
         +- allowed_token_ids: every other token -> -inf   (rows that ask, greedy included)
         +- bad_words: a word's last token -> -inf when the output ends with the rest of the word (vLLM's rule)
         +- repetition / presence / frequency penalties   (rows that ask; token history from the request)
         +- logit_bias                                    (one scatter over every biased (row, token))
         +- structured output: tokens the row's grammar does not allow -> -inf (one bitmask per step,
         |                     engine.structured.matchers)
         +- min_tokens: EOS and stop_token_ids -> -inf     (rows still short of min_tokens, unless that leaves a
         |                     structured row no token: its grammar can only end, and it does)
         |
         +- greedy rows: argmax
         +- other rows:  / temperature -> min_p -> top-k and top-p (one descending sort) -> exponential race
                          argmax(probs / q), q ~ Exp(1): one draw per row from the request's own generator when
                          it has a seed, from the sampler's generator otherwise

Every step is a fixed number of tensor operations whatever the batch holds; Python loops only build index lists
(penalised rows' token histories, biased tokens) and draw seeded rows' noise. vLLM semantics: presence and
frequency penalties count output tokens; the repetition penalty applies to prompt and output tokens (logit / p
when positive, * p when negative).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter
from typing import Protocol

import torch
from hybridpd.engine.sampling_params import SamplingParams

TopLogprobs = list[tuple[int, float]]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # type: ignore[type-arg]
    """`values` on `device`. On CUDA through pinned memory, without waiting for the stream: a step launched while
    the previous one still runs must not wait for it (a copy from pageable memory would)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class _History(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]


_plain_key = attrgetter("temperature", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                        "structured_output", "min_tokens", "top_logprobs", "allowed_token_ids",
                        "bad_words_token_ids")
_PLAIN = (0.0, 0.0, 0.0, 1.0, None, None, 0, 0, None, ())
"""A row whose parameters read so (`_plain_key`) is greedy with nothing to apply: no penalty, bias, grammar,
min_tokens, allowed-token list, bad words or top logprobs (min_p, top-k and top-p act after temperature: never on greedy
rows). A step of such rows only is its logits' argmax (`Sampler.sample_rows`' fast path: no per-row Python loop)."""


class Sampler:
    """Ownership: the runner calls `sample` once per step on the rows that need a token (step thread). Per-request
    generators (seeded requests) live here until `forget(request_id)`. The engine `bind`s a lookup from request id
    to the request (for penalties and min_tokens) and its EOS ids; after each `sample`, `take_top_logprobs()` hands
    over the alternatives computed for rows that asked for them."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.global_gen = torch.Generator(device=device)
        self.global_gen.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self._skips: dict[str, int] = {}
        """request id -> draws its seeded generator makes (and discards) when created: the samples another engine
        made for it (a decode worker continuing from the prefill worker's first token)."""
        self._lookup: Callable[[str], _History | None] = lambda rid: None
        self._eos: tuple[int, ...] = ()
        self._top: dict[str, TopLogprobs] = {}
        self._allowed: dict[str, torch.Tensor] = {}
        """request id -> its `allowed_token_ids` inside the vocabulary, on the device (made once per request: a
        list as long as the vocabulary is not rebuilt every step)."""
        self._constrain: Callable[[torch.Tensor, list[str], list[SamplingParams]], None] | None = None
        self.unread_outputs = 0
        self.unread_tokens: torch.Tensor | None = None
        """A step launched before the previous one was read (asynchronous scheduling): every row has one sampled
        token its request does not hold yet (`unread_outputs` 1), on the device, row by row (`unread_tokens`);
        min_tokens counts it, the penalties count it in the row's output history. 0 / None otherwise."""

    def bind_constraint(self, constrain: Callable[[torch.Tensor, list[str], list[SamplingParams]], None]) -> None:
        """`constrain(logits, request ids, params)` masks, in place, what each structured row may not sample."""
        self._constrain = constrain

    def bind(self, lookup: Callable[[str], _History | None], eos_token_ids: Sequence[int]) -> None:
        self._lookup = lookup
        self._eos = tuple(eos_token_ids)

    def _generator(self, request_id: str, params: SamplingParams, width: int) -> torch.Generator:
        """`width`: the logits' row width (one draw of the exponential race is `width` values)."""
        if params.seed is None:
            return self.global_gen
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            for _ in range(self._skips.pop(request_id, 0)):
                torch.empty(width, device=self.device).exponential_(generator=gen)
            self.generators[request_id] = gen
        return gen

    def skip_samples(self, request_id: str, params: SamplingParams, n: int) -> None:
        """The request's first `n` tokens were sampled elsewhere (a prefill worker) with the same seed: its generator
        here starts past their draws, so its next sample is the one a single engine would draw. Greedy or unseeded
        requests draw nothing from their own generator."""
        if n > 0 and params.seed is not None and not params.greedy and request_id not in self.generators:
            self._skips[request_id] = n

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self._skips.pop(request_id, None)
        self._allowed.pop(request_id, None)

    def hold_top_logprobs(self, top: dict[str, TopLogprobs]) -> None:
        """What `take_top_logprobs` hands over next (a step sampled with `sample_rows` and resolved by the runner)."""
        self._top = top

    def take_top_logprobs(self) -> dict[str, TopLogprobs]:
        """{request id: [(token id, logprob), ...] best first} of the last `sample`, for rows with top_logprobs."""
        top, self._top = self._top, {}
        return top

    # -- the step ------------------------------------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        lse: torch.Tensor | None = None,
    ) -> tuple[list[int], list[float]]:
        """`lse`: logsumexp of the raw logits per row when the caller has it (a CUDA graph computes it)."""
        tokens, logprobs, self._top = self.sample_rows(logits, request_ids, params, lse).resolve()
        return tokens, logprobs

    def sample_rows(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        lse: torch.Tensor | None = None,
    ) -> SampledRows:
        """`sample` without reading the results: the tokens stay on the device (a step launched before this one's
        tokens are read is fed from them) and their copies to the host are only started."""
        logits = logits.float()
        if lse is None:  # log_softmax(x)[t] = x[t] - lse: no [rows, vocab] tensor written
            lse = torch.logsumexp(logits, dim=-1)
        if all(map(_PLAIN.__eq__, map(_plain_key, params))):  # what the rest does for such rows, without its loops
            tokens = torch.argmax(logits, dim=-1)
            chosen = logits.gather(1, tokens.view(-1, 1)).view(-1) - lse
            return SampledRows(tokens, chosen, None, request_ids, [0] * len(params))
        x = self._process(logits, request_ids, params)
        tokens = torch.argmax(x, dim=-1)
        if not all(p.greedy for p in params):
            tokens = torch.where(self._greedy_mask(params), tokens, self._sample(x, request_ids, params))
        chosen = logits.gather(1, tokens.view(-1, 1)).view(-1) - lse
        k = max((p.top_logprobs for p in params), default=0)
        top = None
        if k > 0:
            values, ids = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
            top = (values - lse[:, None], ids)
        return SampledRows(tokens, chosen, top, request_ids, [p.top_logprobs for p in params])

    def _greedy_mask(self, params: list[SamplingParams]) -> torch.Tensor:
        return self._upload([p.greedy for p in params], torch.bool)

    def _process(self, logits: torch.Tensor, rids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """Allowed tokens, bad words, penalties, logit bias, min_tokens and structured-output masking; returns
        `logits` itself when no row asks for any."""
        x = self._allow_only(logits, rids, params)
        ban_rows, ban_ids = self._bad_words_masks(rids, params)
        if ban_rows:
            x = x.clone() if x is logits else x
            x[self._t(ban_rows), self._t(ban_ids)] = float("-inf")
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if rows:
            x = x.clone() if x is logits else x
            self._penalise(x, rows, rids, params)
        bias_rows, bias_ids, bias_vals = [], [], []
        for i, p in enumerate(params):
            for tid, b in p.logit_bias or ():  # type: ignore[misc]
                if tid < x.shape[-1]:
                    bias_rows.append(i)
                    bias_ids.append(tid)
                    bias_vals.append(b)
        if bias_rows:
            x = x.clone() if x is logits else x
            x.index_put_((self._t(bias_rows), self._t(bias_ids)),
                         self._upload(bias_vals, x.dtype), accumulate=True)
        structured = self._constrain is not None and any(p.structured_output is not None for p in params)
        if structured:
            x = x.clone() if x is logits else x
            self._constrain(x, rids, params)  # type: ignore[misc]
        mask_rows, mask_ids = self._min_tokens_masks(rids, params, x.shape[-1])
        if mask_rows:
            x = x.clone() if x is logits else x
            rows_t, ids_t = self._t(mask_rows), self._t(mask_ids)
            kept = x[rows_t, ids_t]
            x[rows_t, ids_t] = float("-inf")
            if structured:  # a grammar that allows nothing but the end ends, min_tokens or not
                dead = torch.isneginf(x).all(dim=-1)[rows_t]
                x[rows_t[dead], ids_t[dead]] = kept[dead]
        return x

    def _allow_only(self, logits: torch.Tensor, rids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """Rows with `allowed_token_ids`: every other token -> -inf (a copy of `logits`; `logits` itself if none).
        One indexing per such row per step: each request's ids go to the device once (`_allowed`)."""
        masked = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if not masked:
            return logits
        vocab = logits.shape[-1]
        keep = torch.ones(logits.shape, dtype=torch.bool, device=self.device)
        keep[self._t(masked)] = False
        for i in masked:
            ids = self._allowed.get(rids[i])
            if ids is None:
                ids = to_device([t for t in params[i].allowed_token_ids or () if t < vocab], torch.int64, self.device)
                self._allowed[rids[i]] = ids
            keep[i, ids] = True
        return logits.masked_fill(~keep, float("-inf"))

    def _bad_words_masks(self, rids: list[str], params: list[SamplingParams]) -> tuple[list[int], list[int]]:
        """(row, token) pairs to ban: each bad word's last token where the row's output ends with the word's other
        tokens (vLLM's `apply_bad_words`: a word longer than the output plus one is skipped). Under asynchronous
        scheduling a row's unread token is read from the device (only for rows with words of several tokens)."""
        rows: list[int] = []
        ids: list[int] = []
        for i, p in enumerate(params):
            words = p.bad_words_token_ids
            if not words:
                continue
            out: list[int] = []
            if any(len(w) > 1 for w in words):
                h = self._lookup(rids[i])
                out = list(h.output_token_ids) if h is not None else []
                if self.unread_tokens is not None:
                    out.append(int(self.unread_tokens[i]))
            for w in words:
                n = len(w) - 1
                if n <= len(out) and (n == 0 or tuple(out[-n:]) == w[:-1]):
                    rows.append(i)
                    ids.append(w[-1])
        return rows, ids

    def _t(self, values: list[int]) -> torch.Tensor:
        return self._upload(values, torch.int64)

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[type-arg]
        return to_device(values, dtype, self.device)

    def _penalise(self, x: torch.Tensor, rows: list[int], rids: list[str], params: list[SamplingParams]) -> None:
        """Every index and value goes up through pinned memory (`_t`, `_upload`): nothing here waits for a step
        still running on the device (asynchronous scheduling)."""
        vocab = x.shape[-1]
        hist = [self._lookup(rids[r]) for r in rows]
        outputs = [h.output_token_ids if h is not None else [] for h in hist]
        prompts = [h.prompt_token_ids if h is not None else [] for h in hist]
        n = len(rows)
        rows_t = self._t(rows)
        counts = torch.zeros(n, vocab + 1, dtype=x.dtype, device=self.device)  # column `vocab` absorbs bad ids
        local = list(chain.from_iterable([j] * len(o) for j, o in enumerate(outputs)))
        if local:
            ids = self._t(list(chain.from_iterable(outputs))).clamp_(0, vocab)
            counts.index_put_((self._t(local), ids), torch.ones(len(local), dtype=x.dtype, device=self.device),
                              accumulate=True)
        if self.unread_tokens is not None:  # each row's last token, sampled but not read into its request yet
            ids = self.unread_tokens.index_select(0, rows_t).clamp(0, vocab)
            counts.index_put_((torch.arange(n, device=self.device), ids),
                              torch.ones(n, dtype=x.dtype, device=self.device), accumulate=True)
        seen = counts > 0
        rep = [params[r].repetition_penalty for r in rows]
        if any(v != 1.0 for v in rep):
            in_prompt = torch.zeros(n, vocab + 1, dtype=torch.bool, device=self.device)
            local_p = list(chain.from_iterable([j] * len(p) for j, p in enumerate(prompts)))
            if local_p:
                ids = self._t(list(chain.from_iterable(prompts))).clamp_(0, vocab)
                in_prompt[self._t(local_p), ids] = True
            hit = (seen | in_prompt)[:, :vocab]
            r = self._upload(rep, x.dtype).unsqueeze(1)
            sub = x[rows_t]
            sub = torch.where(hit, torch.where(sub > 0, sub / r, sub * r), sub)
            x[rows_t] = sub
        freq = self._upload([params[r].frequency_penalty for r in rows], x.dtype)
        pres = self._upload([params[r].presence_penalty for r in rows], x.dtype)
        x[rows_t] -= freq.unsqueeze(1) * counts[:, :vocab] + pres.unsqueeze(1) * seen[:, :vocab].to(x.dtype)

    def _min_tokens_masks(self, rids: list[str], params: list[SamplingParams], vocab: int
                          ) -> tuple[list[int], list[int]]:
        rows: list[int] = []
        ids: list[int] = []
        for i, p in enumerate(params):
            if p.min_tokens <= 0:
                continue
            h = self._lookup(rids[i])
            if h is not None and len(h.output_token_ids) + self.unread_outputs >= p.min_tokens:
                continue
            banned = {t for t in (*self._eos, *p.stop_token_ids) if t < vocab}
            rows += [i] * len(banned)
            ids += sorted(banned)
        return rows, ids

    def _sample(self, x: torch.Tensor, rids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """One token per row by temperature, top-k, top-p and the exponential race (greedy rows get a value too;
        the caller ignores it)."""
        vocab = x.shape[-1]
        temp = self._upload([p.temperature if p.temperature > 0 else 1.0 for p in params], x.dtype)
        x = x / temp.unsqueeze(1)
        min_p = [p.min_p for p in params]
        if any(v > 0.0 for v in min_p):
            x = self._min_p(x, min_p)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(v < 1.0 for v in top_p):
            x = self._top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.global_gen)
        for i, (rid, p) in enumerate(zip(rids, params, strict=True)):
            if p.seed is not None and not p.greedy:
                q[i].exponential_(generator=self._generator(rid, p, vocab))
        return torch.argmax(probs / q, dim=-1)

    def _min_p(self, x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
        """vLLM's rule: -inf every token whose probability is below min_p x the row's largest (0 keeps all)."""
        probs = torch.softmax(x, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * self._upload(min_p, x.dtype).unsqueeze(1)
        return x.masked_fill(probs < threshold, float("-inf"))

    def _top_k_top_p(self, x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Keep each row's top_k logits and then the smallest set whose probability reaches top_p; -inf the rest."""
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        pos = torch.arange(x.shape[-1], device=self.device).unsqueeze(0)
        drop = pos >= self._t(top_k).unsqueeze(1)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        p = self._upload(top_p, x.dtype).unsqueeze(1)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        sorted_x = sorted_x.masked_fill((cum - probs) > p, float("-inf"))
        return torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x)


class SampledRows:
    """One step's samples: `tokens` [rows] on the device (what a step launched before they are read is fed from),
    and their copies to the host, started at once (non-blocking into pinned memory on CUDA) so that `resolve` waits
    for this step's sampling only, not for a step launched after it."""

    def __init__(self, tokens: torch.Tensor, chosen: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 request_ids: list[str], top_counts: list[int]) -> None:
        self.tokens = tokens
        self.request_ids = request_ids
        self._top_counts = top_counts
        parts = [tokens, chosen, *(top or ())]
        self._event = None
        if tokens.device.type == "cuda":
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for h, t in zip(host, parts, strict=True):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))  # the copies' stream, not the current device's
            parts = host
        self._host = parts

    def resolve(self) -> tuple[list[int], list[float], dict[str, TopLogprobs]]:
        """(tokens, chosen-token logprobs, {request id: top logprobs} for rows that asked): waits for the copies."""
        if self._event is not None:
            self._event.synchronize()
        tokens, chosen, *top = (t.tolist() for t in self._host)
        out: dict[str, TopLogprobs] = {}
        if top:
            values, ids = top
            for i, (rid, k) in enumerate(zip(self.request_ids, self._top_counts, strict=True)):
                if k > 0:
                    out[rid] = list(zip(ids[i][:k], values[i][:k], strict=True))
        return tokens, chosen, out
