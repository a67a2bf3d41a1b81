"""UCX settings the transfer agent puts in place for GPU caches (kvtransfer.agent.apply_ucx_defaults): cuda_ipc's
GET must be on where NVML reports no NVLink (one GPU per host, PCIe GPUs), or UCX stages every READ through host
memory; the operator's own value always wins, and a host-memory cache changes nothing."""

from __future__ import annotations

import os

import pytest
from hybridpd.kvtransfer.agent import UCX_GPU_DEFAULTS, apply_ucx_defaults

KEY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


@pytest.fixture
def clean_env(monkeypatch):  # type: ignore[no-untyped-def]
    for k in UCX_GPU_DEFAULTS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_gpu_cache_turns_cuda_ipc_get_on(clean_env) -> None:  # type: ignore[no-untyped-def]
    assert apply_ucx_defaults("cuda") == {KEY: "y"}
    assert os.environ[KEY] == "y"


def test_operator_value_wins(clean_env) -> None:  # type: ignore[no-untyped-def]
    clean_env.setenv(KEY, "n")
    assert apply_ucx_defaults("cuda") == {}
    assert os.environ[KEY] == "n"


def test_host_memory_cache_sets_nothing(clean_env) -> None:  # type: ignore[no-untyped-def]
    assert apply_ucx_defaults("cpu") == {}
    assert KEY not in os.environ
