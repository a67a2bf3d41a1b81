"""--device auto / --dtype auto, and the refusal of a CUDA engine that would run the reference path."""

from __future__ import annotations

import pytest
import torch
from hybridpd.engine import device as dev
from hybridpd.engine.config import EngineConfig
from hybridpd.engine.core import resolve_auto
from hybridpd.engine.errors import HybridPDError, InvalidRequestError


def test_auto_is_cpu_float32_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.resolve_device("auto") == "cpu" and dev.resolve_dtype("auto", "auto") == "float32"
    cfg = resolve_auto(EngineConfig.from_settings("/m"))
    assert (cfg.model.device, cfg.model.dtype) == ("cpu", "float32")


def test_auto_is_cuda_bfloat16_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    cfg = resolve_auto(EngineConfig.from_settings("/m"))
    assert (cfg.model.device, cfg.model.dtype) == ("cuda", "bfloat16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert dev.resolve_dtype("auto", "cuda:1") == "float16"
    assert dev.resolve_dtype("float32", "cuda") == "float32" and dev.resolve_device("cpu") == "cpu"  # explicit wins


@pytest.mark.parametrize(
    ("checkpoint", "bf16", "want"),
    [
        ({"torch_dtype": "bfloat16"}, True, "bfloat16"),
        ({"torch_dtype": "float16"}, True, "float16"),  # vLLM keeps a float16 checkpoint in float16 on an H100
        ({"torch_dtype": "float32"}, True, "bfloat16"),  # float32 checkpoints are downcast to the preferred dtype
        ({}, True, "bfloat16"),  # no dtype named: as float32
        ({"dtype": "torch.float16", "torch_dtype": "bfloat16"}, True, "float16"),  # `dtype` first, as transformers
        ({"text_config": {"torch_dtype": "float16"}}, True, "float16"),  # multimodal: the text model's
        ({"torch_dtype": "bfloat16"}, False, "float16"),  # a GPU without bf16 runs it in float16 (a warning)
        ({"torch_dtype": "float32"}, False, "float16"),
    ],
)
def test_dtype_auto_follows_the_checkpoint_on_cuda_as_vllm(
    monkeypatch: pytest.MonkeyPatch, checkpoint: dict, bf16: bool, want: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    assert dev.resolve_dtype("auto", "cuda", checkpoint) == want
    assert resolve_auto(EngineConfig.from_settings("/m"), checkpoint).model.dtype == want
    assert dev.resolve_dtype("auto", "cpu", checkpoint) == "float32"  # the CPU runs float32 whatever the checkpoint


def test_a_gpu_with_only_emulated_bf16_runs_float16_as_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Ampere (T4, V100) torch.cuda.is_bf16_supported() is True by emulation: auto must still pick float16
    (vLLM: bf16 from compute capability 8.0), and an explicit bfloat16 is refused naming --dtype half, as vLLM."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert dev.resolve_dtype("auto", "cuda") == "float16"
    assert dev.resolve_dtype("auto", "cuda", {"torch_dtype": "bfloat16"}) == "float16"
    with pytest.raises(InvalidRequestError, match=r"bfloat16 needs a GPU of compute capability 8\.0.*--dtype half"):
        dev.resolve_dtype("bfloat16", "cuda")
    assert dev.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # the CPU runs bf16


def test_auto_says_what_it_chose(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("INFO", logger="hybridpd.engine"):
        resolve_auto(EngineConfig.from_settings("/m"), {"torch_dtype": "bfloat16"})
    assert "device auto -> cpu (no CUDA device is visible), dtype auto -> float32 (the CPU runs float32)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="hybridpd.engine"):
        resolve_auto(EngineConfig.from_settings("/m", device="cpu", dtype="float32"))
    assert "auto" not in caplog.text  # nothing chosen: nothing said


def test_cuda_without_fla_refuses_naming_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(dev, "FAST_PATH_PACKAGES", (("no_such_module_xyz", "fla-core"),))
    with pytest.raises(
        InvalidRequestError, match=r"fla-core \(not installed\).*hybridpd\[gpu\].*--allow-reference-path"
    ):
        dev.require_fast_path("cuda", allow_reference_path=False)
    dev.require_fast_path("cuda", allow_reference_path=True)  # told to: starts
    dev.require_fast_path("cpu", allow_reference_path=False)  # the CPU always runs the reference path
    # installed but broken (built for another torch): refused too, with the import's own error
    (tmp_path / "broken_fla_xyz.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dev, "FAST_PATH_PACKAGES", (("broken_fla_xyz", "fla-core"),))
    with pytest.raises(
        InvalidRequestError,
        match=r"fla-core \(installed, but `import broken_fla_xyz` fails: "
        r"ImportError: undefined symbol: _ZN3c10\)",
    ):
        dev.require_fast_path("cuda:0", allow_reference_path=False)
    assert dev.missing_fast_path_packages() == []  # found; importing is only tried for a CUDA engine


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

    assert default_gpus_per_worker(None, "auto", cluster_gpus=2.0, gpus_needed=2) == 1.0
    assert default_gpus_per_worker(None, "cuda:0", cluster_gpus=4.0, gpus_needed=2) == 1.0
    assert default_gpus_per_worker(None, "auto", cluster_gpus=0.0, gpus_needed=2) == 0.0  # no GPU: the CPU
    assert default_gpus_per_worker(None, "cpu", cluster_gpus=8.0, gpus_needed=2) == 0.0
    assert default_gpus_per_worker(0.5, "auto", cluster_gpus=0.0, gpus_needed=2) == 0.5  # asked: as asked
    assert default_gpus_per_worker(0.5, "auto", cluster_gpus=1.0, gpus_needed=2) == 0.5
    # some GPUs, not one per rank: refused (auto would have run every worker on the CPU, Ray hiding the GPU)
    with pytest.raises(HybridPDError, match=r"need 2 GPUs .* has 1: share them .*--gpus-per-worker 0.5"):
        default_gpus_per_worker(None, "auto", cluster_gpus=1.0, gpus_needed=2)
    with pytest.raises(HybridPDError, match="need 4 GPUs"):  # two workers of two tensor-parallel ranks each
        default_gpus_per_worker(None, "cuda", cluster_gpus=2.0, gpus_needed=4)


def test_a_cuda_device_that_is_not_there_is_named_before_anything_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequestError, match=r"--device cuda: no such CUDA device .*--device auto picks the CPU"):
        dev.require_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    dev.require_device("cuda:1")
    with pytest.raises(InvalidRequestError, match=r"--device cuda:2: no such CUDA device \(2 are visible\)"):
        dev.require_device("cuda:2")
    dev.require_device("cpu")
    with pytest.raises(InvalidRequestError, match="device must be"):
        EngineConfig.from_settings("/m", device="cuda:x").validate()
