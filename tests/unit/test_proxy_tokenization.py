"""`proxy.tokenization`: tokenizer.json loading, the model's chat template (jinja2), the documented fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridpd.proxy.errors import ApiError
from hybridpd.proxy.openai_schema import ChatMessage
from hybridpd.proxy.tokenization import PromptTokenizer, render_fallback

from tests.support.fake_workers import write_fake_tokenizer

MSGS = (ChatMessage("system", "Be terse."), ChatMessage("user", "Hi"))
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_fallback_format(tmp_path: Path) -> None:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path))
    assert not tok.has_chat_template
    text = "<|system|>\nBe terse.\n<|user|>\nHi\n<|assistant|>\n"
    assert render_fallback(MSGS) == tok.render_chat(MSGS) == text
    assert tok.encode_chat(MSGS) == list(text.encode())


def test_encode_and_token_text(tmp_path: Path) -> None:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path))
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.vocab_size == 257
    assert [tok.token_text(t) for t in tok.encode("ab")] == ["a", "b"]
    assert tok.token_text(256) == "<|endoftext|>"


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    tok = PromptTokenizer.from_dir(write_fake_tokenizer(tmp_path, chat_template=TEMPLATE))
    assert tok.has_chat_template
    text = tok.render_chat(MSGS)
    assert text == "[system]Be terse.<|endoftext|>[user]Hi<|endoftext|>[assistant]"
    ids = tok.encode_chat(MSGS)
    assert ids.count(256) == 2 and len(ids) == len(text.replace("<|endoftext|>", "")) + 2


def test_named_template_list_and_jinja_file(tmp_path: Path) -> None:
    root = write_fake_tokenizer(tmp_path / "a")
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert PromptTokenizer.from_dir(root).render_chat(MSGS) == "D"
    root = write_fake_tokenizer(tmp_path / "b")
    (root / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert PromptTokenizer.from_dir(root).render_chat(MSGS) == "2 messages"


def test_template_errors_are_400(tmp_path: Path) -> None:
    root = write_fake_tokenizer(tmp_path, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ApiError) as err:
        PromptTokenizer.from_dir(root).encode_chat(MSGS)
    assert err.value.status == 400 and "roles must alternate" in err.value.message


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        PromptTokenizer.from_dir(tmp_path)
