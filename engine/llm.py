"""The offline API: `LLM(model=...).generate(prompts, sampling_params) -> list[RequestOutput]`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Colocated engine for offline batch generation (DESIGN.md contract)."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        checkpoint_interval: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_checkpoint_slots: int | None = None,
        zero_fresh_blocks: str = "auto",
        seed: int = 0,
        config: EngineConfig | None = None,
    ) -> None:
        """Either the keyword settings above, or a whole `config` (what the CLI builds from its flags); not both."""
        if config is not None:
            if model is not None and model != config.model.path:
                raise InvalidRequestError("LLM(model=..., config=...): the model path is the config's")
            self.config = config
            self.engine = EngineCore(config)
            self._ids = itertools.count()
            return
        if model is None:
            from engine.default_model import default_model_path

            model = default_model_path()
        self.config = EngineConfig(
            model=ModelConfig(path=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed),
            cache=CacheConfig(
                block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                checkpoint_interval=checkpoint_interval, num_checkpoint_slots=num_checkpoint_slots,
                kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                zero_fresh_blocks=zero_fresh_blocks,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        )
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def kv_cache_info(self) -> dict[str, int]:
        return self.engine.kv_cache_info()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        token_lists = self._tokenize(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(token_lists) if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(token_lists):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(token_lists)} prompts")
        for ids in token_lists:  # validate everything before anything runs
            self.engine.validate_prompt(ids)
        reqs = [
            self.engine.add_request(f"offline-{next(self._ids)}", ids, p)
            for ids, p in zip(token_lists, params, strict=True)
        ]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.make_output(r) for r in reqs]

    def _tokenize(
        self, prompts: str | Sequence[str] | None, prompt_token_ids: Sequence[Sequence[int]] | None
    ) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(p) for p in prompt_token_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        if self.engine.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer: pass prompt_token_ids")
        assert prompts is not None
        return [self.engine.tokenizer.encode(p) for p in prompts]
