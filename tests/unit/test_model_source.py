"""Hugging Face model ids resolved from a local cache (the HF_HOME layout, offline) and the CLI's `serve MODEL`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hybridpd.engine.errors import ModelLoadError
from hybridpd.engine.model_source import looks_like_model_id, resolve_model


def _fake_cache(home: Path, repo: str, src: str) -> Path:
    """HF_HOME/hub/models--ORG--NAME/{refs/main, snapshots/<commit>/...} as huggingface_hub writes it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return snap


def test_model_id_from_the_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridpd.engine.default_model import default_model_path

    snap = _fake_cache(tmp_path / "hf", "acme/tiny-hybrid", default_model_path())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert Path(resolve_model("acme/tiny-hybrid")) == snap
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        resolve_model("acme/absent")
    assert resolve_model(str(snap)) == str(snap)  # a directory is used as is
    assert not looks_like_model_id("/abs/path") and not looks_like_model_id("a/b/c") and looks_like_model_id("a/b")


def test_serve_positional_model_and_remote_code_refusal(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "hybridpd.deploy.cli", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=120)
    r = run("serve", "some-org/missing-model", "--port", "0")
    assert r.returncode == 2 and "some-org/missing-model" in r.stderr and "Traceback" not in r.stderr
    r = run("serve", "x", "--trust-remote-code")
    assert r.returncode == 2 and "--trust-remote-code is refused" in r.stderr
    r = run("serve", "a", "--model", "b")
    assert r.returncode == 2 and "two models" in r.stderr
    r = run("serve", "--modle", "x")
    assert r.returncode == 2 and "did you mean --model?" in r.stderr


def test_chat_template_override(tmp_path: Path) -> None:
    from hybridpd.engine.default_model import default_model_path
    from hybridpd.proxy.openai_schema import ChatMessage
    from hybridpd.proxy.tokenization import PromptTokenizer

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}<go>")
    tok = PromptTokenizer.from_dir(default_model_path(), chat_template=str(tpl))
    assert tok.render_chat([ChatMessage("user", "hi")]) == "[user]hi<go>"
    inline = PromptTokenizer.from_dir(default_model_path(), chat_template="{{ messages[0].content }}!")
    assert inline.render_chat([ChatMessage("user", "hi")]) == "hi!"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-m", "hybridpd.deploy.cli", "proxy", "--decode", "127.0.0.1:1", "--port", "0",
                        "--chat-template", str(tmp_path / "missing.jinja")], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_tokenizer_elsewhere(tmp_path: Path) -> None:
    """--tokenizer / ModelConfig.tokenizer: the engine reads its tokenizer (and chat template) from another
    directory; the flag reaches workers through the engine flags."""
    from hybridpd.deploy.engine_flags import engine_argv
    from hybridpd.engine import LLM
    from hybridpd.engine.default_model import default_model_path

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path()) / name, tok_dir / name)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(tokenizer=str(tok_dir), max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<<x>>"
    assert "--tokenizer" in engine_argv(llm.config)
