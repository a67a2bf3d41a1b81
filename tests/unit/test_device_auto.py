"""--device auto / --dtype auto, and the refusal of a CUDA engine that would run the reference path."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import device as dev
from hybridpd.engine.config import EngineConfig
from hybridpd.engine.core import resolve_auto
from hybridpd.engine.errors import InvalidRequestError


def test_auto_is_cpu_float32_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.resolve_device("auto") == "cpu" and dev.resolve_dtype("auto", "auto") == "float32"
    cfg = resolve_auto(EngineConfig.from_settings("/m"))
    assert (cfg.model.device, cfg.model.dtype) == ("cpu", "float32")


def test_auto_is_cuda_bfloat16_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cfg = resolve_auto(EngineConfig.from_settings("/m"))
    assert (cfg.model.device, cfg.model.dtype) == ("cuda", "bfloat16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert dev.resolve_dtype("auto", "cuda:1") == "float16"
    assert dev.resolve_dtype("float32", "cuda") == "float32" and dev.resolve_device("cpu") == "cpu"  # explicit wins


def test_cuda_without_fla_refuses_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "missing_fast_path_packages", lambda: ["fla-core"])
    with pytest.raises(InvalidRequestError, match=r"fla-core.*hybridpd\[gpu\].*--allow-reference-path"):
        dev.require_fast_path("cuda", allow_reference_path=False)
    dev.require_fast_path("cuda", allow_reference_path=True)  # told to: starts
    dev.require_fast_path("cpu", allow_reference_path=False)  # the CPU always runs the reference path


def test_llm_defaults_to_auto_and_runs_float32_on_cpu() -> None:
    from hybridpd.engine import LLM

    llm = LLM(kv_cache_memory_bytes=16 * 2**20)
    assert (llm.config.model.device, llm.config.model.dtype) == ("auto", "auto")
    assert (llm.engine.config.model.device, llm.engine.config.model.dtype) == ("cpu", "float32")
    assert next(llm.engine.model.parameters()).dtype == torch.float32  # type: ignore[attr-defined]


def test_bad_device_is_still_refused() -> None:
    with pytest.raises(InvalidRequestError, match="auto"):
        EngineConfig.from_settings("/m", device="tpu").validate()


def test_serve_reserves_a_gpu_per_worker_when_the_cluster_has_them() -> None:
    from hybridpd.deploy.ray_launcher import default_gpus_per_worker

    assert default_gpus_per_worker(None, "auto", cluster_gpus=2.0, num_workers=2) == 1.0
    assert default_gpus_per_worker(None, "cuda:0", cluster_gpus=4.0, num_workers=2) == 1.0
    assert default_gpus_per_worker(None, "auto", cluster_gpus=1.0, num_workers=2) == 0.0  # not one each: none
    assert default_gpus_per_worker(None, "cpu", cluster_gpus=8.0, num_workers=2) == 0.0
    assert default_gpus_per_worker(0.5, "auto", cluster_gpus=0.0, num_workers=2) == 0.5  # asked: as asked
