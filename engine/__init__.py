"""hybridpd engine: everything prefill and decode workers share.

`from hybridpd import LLM, SamplingParams` (or `hybridpd.engine`). Imports are lazy so that tensor-free parts
(`engine.cache`, `engine.scheduler`) can be used without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridpd.engine.llm import LLM
    from hybridpd.engine.request import RequestOutput
    from hybridpd.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from hybridpd.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybridpd.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from hybridpd.engine.request import RequestOutput

        return RequestOutput
    raise AttributeError(name)
