"""hybridpd: disaggregated prefill/decode serving for hybrid (Mamba-2 / Gated-DeltaNet + attention) LLMs.

`from hybridpd import LLM, SamplingParams` is the offline API. The runtime packages are installed under this one
name (`hybridpd.engine`, `hybridpd.proxy`, `hybridpd.prefill`, `hybridpd.decode`, `hybridpd.kvtransfer`,
`hybridpd.proto`, `hybridpd.worker`, `hybridpd.deploy`); in the repository they are the top-level folders of the same
names (pyproject.toml maps them). Imports are lazy so `import hybridpd` loads no torch.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridpd.engine.llm import LLM
    from hybridpd.engine.request import RequestOutput
    from hybridpd.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

try:
    __version__ = metadata.version("hybridpd")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from hybridpd import engine

        return getattr(engine, name)
    raise AttributeError(name)
