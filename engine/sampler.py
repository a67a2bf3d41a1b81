"""Sampling from float32 logits: greedy, temperature, top-k, top-p, per-request seeds. Returns the chosen token and
its log-probability under the raw (untempered) distribution, as `transformers` reports it."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    """Ownership: the runner calls `sample` once per step on the rows that need a token. Per-request generators
    (seeded requests) live here until `forget(request_id)`."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.global_gen = torch.Generator(device=device)
        self.global_gen.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.global_gen
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self.generators[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> tuple[list[int], list[float]]:
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.greedy:
                continue
            tokens[row] = self._sample_row(logits[row], p, self._generator(rid, p))
        chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1)
        return tokens.tolist(), chosen.tolist()

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        scaled = logits / p.temperature
        if p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop = (cum - sorted_probs) > p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=gen)[0]
