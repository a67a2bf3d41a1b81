"""Chat content sent as a list of text parts reaches the chat template as vLLM 0.33 passes it: a template that loops
over a message's content gets the list itself (`[{"type": "text", "text": ...}]`); any other gets the parts' texts
joined by newlines (vLLM's "string" content format), and chat echo repeats that joined text. The detection is
checked against vLLM's own where vLLM is installed."""

from __future__ import annotations

import pytest
from hybridpd.engine.chat_template import ChatTemplate
from hybridpd.proxy.openai_schema import parse_chat
from hybridpd.proxy.tokenization import PromptTokenizer

STRING_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
PARTS_TEMPLATE = (
    "{% for message in messages %}<{{ message.role }}>{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}[{{ part.type }}:{{ part.text }}]{% endfor %}{% endif %}</>"
    "{% endfor %}"
)
TEMPLATES = {
    "string": STRING_TEMPLATE,
    "parts": PARTS_TEMPLATE,
    "parts_by_item": "{% for m in messages %}{% for p in m['content'] | list %}{{ p['text'] }}{% endfor %}{% endfor %}",
    "content_variable": "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}"
                        "{% endfor %}{% endfor %}",
    "tool_calls_only": "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}{{ c }}{% endfor %}"
                       "{% endfor %}",
}
WANT = {"string": "string", "parts": "openai", "parts_by_item": "openai", "content_variable": "openai",
        "tool_calls_only": "string"}
BODY = {"model": "m", "messages": [{"role": "system", "content": "Be terse."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                {"type": "text", "text": "world"}]}]}


def _tokenizer(template: str | None) -> PromptTokenizer:
    from hybridpd.engine.default_model import default_model_path

    return PromptTokenizer.from_dir(default_model_path(), chat_template=template)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_detected_as_vllm_does(name: str) -> None:
    assert ChatTemplate(TEMPLATES[name]).content_format == WANT[name]
    hf = pytest.importorskip("vllm.renderers.hf", reason="vLLM is not installed here")
    assert hf._detect_content_format(TEMPLATES[name], default="string") == WANT[name]


def test_string_templates_get_the_parts_joined_by_newlines() -> None:
    req = parse_chat(BODY, "m")
    assert req.messages[1].content == "Hello\nworld"  # also what chat echo repeats
    assert _tokenizer(STRING_TEMPLATE).render_chat(req.messages) == "<system>Be terse.</><user>Hello\nworld</>"


def test_templates_that_loop_over_content_get_the_parts() -> None:
    req = parse_chat(BODY, "m")
    text = _tokenizer(PARTS_TEMPLATE).render_chat(req.messages)
    assert text == "<system>Be terse.</><user>[text:Hello][text:world]</>"


def test_the_models_own_template_joins_by_newlines() -> None:
    tok = _tokenizer(None)  # the built-in model's ChatML template takes content as a string
    assert tok._template.content_format == "string"
    assert "Hello\nworld" in tok.render_chat(parse_chat(BODY, "m").messages)
