"""Choose the forward path of the engines a test builds (the runner picks it once, from the device: the batched
path on CUDA with fla-core, else the reference)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock


@contextmanager
def forward_path(fast: bool) -> Iterator[None]:
    """Engines built inside, in this process, run the batched path (`fast`; on CPU its Triton kernels need
    TRITON_INTERPRET=1) or the reference, whatever the device (tensor-parallel followers, other processes, pick
    their own)."""
    with mock.patch("hybridpd.engine.runner.default_fast_path", lambda device: fast):
        yield
