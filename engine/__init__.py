"""hybridpd engine: everything prefill and decode workers share.

`from engine import LLM, SamplingParams` (DESIGN.md contract). Imports are lazy so that tensor-free parts
(`engine.cache`, `engine.scheduler`) can be used without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.request import RequestOutput
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from engine.request import RequestOutput

        return RequestOutput
    raise AttributeError(name)
