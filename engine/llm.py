"""The offline API: `LLM(model=...).generate(prompts, sampling_params) -> list[RequestOutput]`, and
`LLM.chat(messages, sampling_params)` (vLLM's: the model's chat template, then generate)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hybridpd.engine.config import EngineConfig
from hybridpd.engine.core import EngineCore
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.request import RequestOutput
from hybridpd.engine.sampling_params import SamplingParams


class LLM:
    """Colocated engine for offline batch generation (a public contract)."""

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **settings: Any) -> None:
        """Either keyword settings, each named like a field of engine.config's sections (`dtype`, `block_size`,
        `enable_prefix_caching`, `checkpoint_interval`, `max_num_seqs`, `kv_cache_memory_bytes`, ...; defaults
        there), or a whole `config` (what the CLI builds from its flags); not both. No `model`: the built-in tiny
        model."""
        if config is not None:
            if settings:
                raise InvalidRequestError(f"LLM(config=...) takes no other settings, got {sorted(settings)}")
            if model is not None and model != config.model.path:
                raise InvalidRequestError("LLM(model=..., config=...): the model path is the config's")
        else:
            if model is None:
                from hybridpd.engine.default_model import default_model_path

                model = default_model_path()
            else:  # a Hugging Face model id: its snapshot in the local cache (downloaded if allowed)
                from hybridpd.engine.model_source import resolve_model

                model = resolve_model(model)
            config = EngineConfig.from_settings(model, **settings)
        self.config = config
        self.engine = EngineCore(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel ranks (nothing to do at tensor_parallel_size 1)."""
        self.engine.shutdown()

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
        for p in params:
            if p.structured is not None:
                self.engine.structured.check(p.structured)
        reqs = [
            self.engine.add_request(f"offline-{next(self._ids)}", ids, p)
            for ids, p in zip(token_lists, params, strict=True)
        ]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.make_output(r) for r in reqs]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, rendered by the model's chat template
        (with `tools`, OpenAI tool objects, when given; `chat_template_kwargs` as more template variables, e.g.
        {"enable_thinking": False}; `continue_final_message`: continue the last message, as vLLM's `LLM.chat`)
        and generated; one RequestOutput per conversation."""
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this checkpoint has no tokenizer: chat needs one")
        if not messages:
            raise InvalidRequestError("chat needs at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if continue_final_message:
            add_generation_prompt = False  # vLLM's LLM.chat: continuing a message opens no new turn
        ids = [tok.encode_chat(list(c), add_generation_prompt, tools, chat_template_kwargs, continue_final_message)
               for c in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params)

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
