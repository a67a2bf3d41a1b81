"""One chat-template renderer (engine.chat_template) for the engine's Tokenizer and the proxy's PromptTokenizer,
compared with transformers' `apply_chat_template` on the repo's tiny byte-level tokenizer: its own ChatML template,
and templates written here (bos/eos and unset special tokens, whitespace control, raise_exception, loop controls,
namespace, tojson, `{% generation %}`, None-valued message keys), a `{name, template}` list, and the
`chat_template.jinja` / `additional_chat_templates/` files that take priority over tokenizer_config.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hybridpd.engine.chat_template import ChatTemplate, ChatTemplateError, render_fallback
from hybridpd.engine.tokenizer import Tokenizer, write_tokenizer_files
from hybridpd.proxy.errors import ApiError
from hybridpd.proxy.openai_schema import ChatMessage
from hybridpd.proxy.tokenization import PromptTokenizer

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Grüß dich, 你好"},
     {"role": "assistant", "content": "Hallo."}, {"role": "user", "content": "  spaces\n and newline  "}],
]

TEMPLATES = {
    "special_tokens_and_whitespace": """{{ bos_token }}{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] | trim }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}""",
    "unset_tokens_render_empty": "{{ unk_token }}|{{ pad_token }}|{% for m in messages %}{{ m.content }}{% endfor %}",
    "namespace_break_tojson_dict": (
        "{% set ns = namespace(users=0) %}{% for m in messages %}{% if m.role == 'user' %}"
        "{% set ns.users = ns.users + 1 %}{% endif %}{% if loop.index0 >= 3 %}{% break %}{% endif %}"
        "{{ m | tojson }};{% endfor %}users={{ ns.users }} {{ dict(a='ä') | tojson }}"
        "{% if add_generation_prompt %}>>{% endif %}"),
    "generation_tag": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.role }}:{{ m.content }}{% endif %}\n{% endfor %}"),
    "none_keys_are_dropped": (
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}:{{ m.content }};"
        "{% endfor %}"),
}


def _tiny(root: Path, **config: Any) -> Path:
    """The built-in checkpoints' byte-level tokenizer, its tokenizer_config.json updated with `config`."""
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(root, vocab_size=300, model_max_length=512)
    path = root / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return root


def _theirs(root: Path, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root))
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))


def _ours(root: Path, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    engine = Tokenizer.from_pretrained(root).apply_chat_template(messages, add_generation_prompt)
    if add_generation_prompt and all(set(m) == {"role", "content"} for m in messages):
        proxy = PromptTokenizer.from_dir(root).render_chat([ChatMessage(m["role"], m["content"]) for m in messages])
        assert proxy == engine
    return engine


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_builtin_template_matches_transformers(tmp_path: Path, chat: int, add_generation_prompt: bool) -> None:
    root = _tiny(tmp_path)
    assert _ours(root, CHATS[chat], add_generation_prompt) == _theirs(root, CHATS[chat], add_generation_prompt)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_written_templates_match_transformers(tmp_path: Path, name: str, add_generation_prompt: bool) -> None:
    root = _tiny(tmp_path, chat_template=TEMPLATES[name], bos_token="<s>", eos_token="<|endoftext|>",
                 pad_token="<|endoftext|>", unk_token=None)
    for chat in CHATS:
        assert _ours(root, chat, add_generation_prompt) == _theirs(root, chat, add_generation_prompt)
    chat = [{"role": "user", "content": "a", "name": None}, {"role": "user", "content": "b", "name": "bob"}]
    assert _ours(root, chat) == _theirs(root, chat)


def test_template_ids_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    root = _tiny(tmp_path, chat_template=TEMPLATES["special_tokens_and_whitespace"], bos_token="<|im_start|>")
    theirs = AutoTokenizer.from_pretrained(str(root))
    for chat in CHATS:
        want = list(theirs.encode(_theirs(root, chat), add_special_tokens=False))
        assert Tokenizer.from_pretrained(root).encode_chat(chat) == want
        assert PromptTokenizer.from_dir(root).encode_chat([ChatMessage(**m) for m in chat]) == want


def test_raise_exception_like_transformers(tmp_path: Path) -> None:
    import jinja2

    template = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    root = _tiny(tmp_path, chat_template=template)
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        _theirs(root, chat)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer.from_pretrained(root).apply_chat_template(chat)
    with pytest.raises(ApiError) as err:  # the proxy: a 400 naming the template's message
        PromptTokenizer.from_dir(root).encode_chat([ChatMessage(**m) for m in chat])
    assert err.value.status == 400 and "roles must alternate" in err.value.message
    assert _ours(root, [{"role": "user", "content": "a"}]) == _theirs(root, [{"role": "user", "content": "a"}])


def test_sandboxed(tmp_path: Path) -> None:
    root = _tiny(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_pretrained(root).apply_chat_template(CHATS[0])


def test_named_list_default_wins(tmp_path: Path) -> None:
    root = _tiny(tmp_path, chat_template=[{"name": "tool_use", "template": "T{{ messages | length }}"},
                                          {"name": "default", "template": "D{{ messages | length }}"}])
    assert _ours(root, CHATS[1]) == _theirs(root, CHATS[1]) == "D4"


def test_named_list_without_default_uses_the_first(tmp_path: Path) -> None:
    """transformers refuses to render (it needs a name); serving takes the first, as both renderers did."""
    root = _tiny(tmp_path, chat_template=[{"name": "a", "template": "A"}, {"name": "b", "template": "B"}])
    assert _ours(root, CHATS[0]) == "A"


def test_template_files_take_priority(tmp_path: Path) -> None:
    root = _tiny(tmp_path / "jinja", chat_template="from tokenizer_config")
    (root / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}\n")
    # jinja drops one trailing newline
    assert _ours(root, CHATS[1]) == _theirs(root, CHATS[1]) == "<system><user><assistant><user>"

    root = _tiny(tmp_path / "extra", chat_template="from tokenizer_config")
    (root / "additional_chat_templates").mkdir()
    (root / "additional_chat_templates" / "default.jinja").write_text("extra default")
    (root / "additional_chat_templates" / "tool_use.jinja").write_text("extra tools")
    assert _ours(root, CHATS[0]) == _theirs(root, CHATS[0]) == "extra default"


def test_no_template_is_the_one_fallback_format(tmp_path: Path) -> None:
    root = _tiny(tmp_path)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    want = "<|system|>\nBe terse.\n<|user|>\nGrüß dich, 你好\n<|assistant|>\nHallo.\n<|user|>\n  spaces\n and " \
           "newline  \n<|assistant|>\n"
    assert render_fallback(CHATS[1]) == want
    assert _ours(root, CHATS[1]) == want
    assert Tokenizer.from_pretrained(root).apply_chat_template(CHATS[1], add_generation_prompt=False) == \
        want.removesuffix("<|assistant|>\n")
    assert not ChatTemplate.from_dir(root).has_template


def test_empty_conversation_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="no messages"):
        Tokenizer.from_pretrained(_tiny(tmp_path)).apply_chat_template([])


def test_renderer_loads_no_torch() -> None:
    probe = "import sys, engine.chat_template, proxy.tokenization; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


THINKING = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")


def test_template_kwargs_and_continue_final_message_match_transformers(tmp_path: Path) -> None:
    """vLLM's chat_template_kwargs (e.g. Qwen's enable_thinking) and continue_final_message, as transformers
    renders them; through the engine's Tokenizer and the proxy's PromptTokenizer alike."""
    from hybridpd.proxy.openai_schema import ChatRender
    from transformers import AutoTokenizer

    root = _tiny(tmp_path, chat_template=THINKING)
    theirs = AutoTokenizer.from_pretrained(str(root))
    ours, proxy = Tokenizer.from_pretrained(root), PromptTokenizer.from_dir(root)
    chat = [{"role": "user", "content": "hi"}]
    want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert "<think></think>" in want
    assert ours.apply_chat_template(chat, True, template_kwargs={"enable_thinking": False}) == want
    render = ChatRender(template_kwargs=(("enable_thinking", False),))
    assert proxy.render_chat([ChatMessage(**m) for m in chat], None, render) == want
    assert "<think>" not in ours.apply_chat_template(chat, True, template_kwargs={"enable_thinking": True})
    prefill = [*chat, {"role": "assistant", "content": "The answer is "}]
    want = theirs.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    assert want.endswith("The answer is ") and "</assistant>" not in want.rsplit("<assistant>", 1)[1]
    assert ours.apply_chat_template(prefill, False, continue_final_message=True) == want
    render = ChatRender(add_generation_prompt=False, continue_final_message=True)
    assert proxy.render_chat([ChatMessage(**m) for m in prefill], None, render) == want
    for bad in ({"messages": []}, {"add_generation_prompt": False}, {"_secret": 1}):
        with pytest.raises(ChatTemplateError, match="chat_template_kwargs"):
            ours.apply_chat_template(chat, True, template_kwargs=bad)
    with pytest.raises(ChatTemplateError, match="both"):
        ours.apply_chat_template(prefill, True, continue_final_message=True)
