"""Where a model comes from: a local checkpoint directory, or a Hugging Face model id (vLLM's `serve MODEL`).

    resolve_model("/data/ckpt")                    -> "/data/ckpt"                 (a directory: used as is)
    resolve_model("nvidia/NVIDIA-Nemotron-...")    -> the snapshot directory in the Hugging Face cache

A model id is looked up in the local cache first (the `HF_HOME` / `HF_HUB_CACHE` layout:
`hub/models--ORG--NAME/snapshots/<commit>/`, the revision `refs/main` names), then downloaded with huggingface_hub
unless downloads are off (`HF_HUB_OFFLINE=1` or `allow_download=False`). Only the files serving needs are fetched
(config, tokenizer, chat template, safetensors weights); no code from the repository is ever run (there is no
`--trust-remote-code`: both families are implemented here). Plain Python: no torch.
"""

from __future__ import annotations

import os

from hybridpd.engine.errors import ModelLoadError

SERVING_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "additional_chat_templates/*"]


def looks_like_model_id(name: str) -> bool:
    """"org/name" (one slash, no leading dot or slash) that is not an existing path."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.exists(name)


def resolve_model(name: str, revision: str | None = None, allow_download: bool = True,
                  cache_dir: str | None = None) -> str:
    """A local checkpoint directory for `name` (see the module doc; `revision` a branch, tag or commit, `cache_dir`
    another Hugging Face cache than the default); ModelLoadError naming what is missing."""
    if os.path.isdir(name) or not looks_like_model_id(name):
        return name
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency
        raise ModelLoadError(f"{name!r} is not a directory, and huggingface_hub is not installed") from None
    try:
        return str(snapshot_download(name, revision=revision, local_files_only=True, allow_patterns=SERVING_FILES,
                                     cache_dir=cache_dir))
    except LocalEntryNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a malformed cache entry
        raise ModelLoadError(f"{name}: the Hugging Face cache entry cannot be read: {e}") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline or not allow_download:
        raise ModelLoadError(f"{name}: not a directory and not in the Hugging Face cache "
                             f"({cache_dir or _cache_dir()}); downloads are off (HF_HUB_OFFLINE)")
    try:
        return str(snapshot_download(name, revision=revision, allow_patterns=SERVING_FILES, cache_dir=cache_dir))
    except Exception as e:  # noqa: BLE001 - network, auth (gated repos need HF_TOKEN), unknown repository
        raise ModelLoadError(f"{name}: cannot download from the Hugging Face Hub: {type(e).__name__}: {e}") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


__all__ = ["SERVING_FILES", "looks_like_model_id", "resolve_model"]
