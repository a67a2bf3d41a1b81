"""The chat template: one renderer for the engine's `Tokenizer` and the proxy's `PromptTokenizer`.

Where the template comes from, as transformers loads it from a model directory:
  1. `chat_template.jinja` (named "default") and `additional_chat_templates/<name>.jinja`; when any of these files
     exists, tokenizer_config.json's entry is ignored;
  2. else `chat_template` in tokenizer_config.json: a string, or a list of `{"name", "template"}`.
  Several named templates: "default", else the first (transformers asks the caller for a name; a server has none).

Rendering, as transformers does: jinja2's ImmutableSandboxedEnvironment (templates from the Hub are untrusted code;
jinja2 >= 3.1.6, earlier versions have sandbox escapes) with trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag, `raise_exception`, `tojson` without ASCII escaping, `strftime_now`, `dict` and a
`namespace` that refuses underscore names; the variables are `messages` (keys whose value is None dropped),
`add_generation_prompt`, and the special tokens tokenizer_config.json sets (`bos_token`, `eos_token`, ...; unset
ones are undefined, so they render as "").

No template: the fallback format (a documented contract of the proxy), one block per message, then the prompt:

    <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n

A template's text carries its own special tokens, so it is encoded with `add_special_tokens=False`; the fallback
text with the tokenizer's own special-token rules (`carries_special_tokens`).

Threads: a `ChatTemplate` is immutable after construction (the template is compiled once); `render` is safe to call
from several threads at once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from hybridpd.engine.errors import InvalidRequestError, ModelLoadError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
FALLBACK_GENERATION_PROMPT = "<|assistant|>\n"
MIN_JINJA2 = (3, 1, 6)


class ChatTemplateError(InvalidRequestError):
    """The template rejected the messages (its `raise_exception`, a sandbox violation, any rendering error)."""


def render_fallback(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The fallback chat format: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
    return text + (FALLBACK_GENERATION_PROMPT if add_generation_prompt else "")


def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON object file ({} when absent); ModelLoadError when it is not valid JSON."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict (`{"content": ...}`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens the config sets (what transformers passes to the template)."""
    found = {name: token_text(tokenizer_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: text for name, text in found.items() if text is not None}


def find_templates(root: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The model's chat templates by name ("default" for a single one); see the module doc for the order."""
    files = {}
    if (root / "chat_template.jinja").is_file():
        files["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        files.update({p.name.removesuffix(".jinja"): p.read_text(encoding="utf-8")
                      for p in sorted(extra.glob("*.jinja"))})
    if files:
        return files
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


def select_template(templates: Mapping[str, str]) -> str | None:
    return templates.get("default") or next(iter(templates.values()), None)


class ChatTemplate:
    """A model's chat template (or the fallback format), compiled once. `render` is the only entry point."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._compiled = _compile(source) if source is not None else None

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer_config: Mapping[str, Any] | None = None) -> ChatTemplate:
        """The template of a model directory (`tokenizer_config`: its tokenizer_config.json, when already read)."""
        root = Path(path)
        config = read_json(root / "tokenizer_config.json") if tokenizer_config is None else tokenizer_config
        return cls(select_template(find_templates(root, config)), special_tokens(config))

    @property
    def has_template(self) -> bool:
        return self._compiled is not None

    @functools.cached_property
    def content_format(self) -> str:
        """How a message whose content came as a list of text parts reaches the template, as vLLM decides it:
        "openai" (the list itself, `[{"type": "text", "text": ...}]`) when the template loops over a message's
        content, else "string" (the parts' texts joined by newlines)."""
        if self._compiled is None:
            return "string"
        return "openai" if loops_over_content(self._compiled.environment.parse(self.source)) else "string"

    @property
    def carries_special_tokens(self) -> bool:
        """Whether rendered text already holds its special tokens (encode it with add_special_tokens=False)."""
        return self.has_template

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, template_kwargs: Mapping[str, Any] | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt text of `messages` ([{"role", "content", ...}]; an assistant's `tool_calls` and a tool
        message's `tool_call_id` as transformers passes them) with `tools` (OpenAI tool objects, or None) as the
        template's `tools` variable. `template_kwargs`: more template variables (e.g. Qwen's `enable_thinking`;
        vLLM's `chat_template_kwargs`); they cannot replace the ones named here. `continue_final_message`: the
        text ends where the last message's content ends (no end-of-turn after it), so that the model continues
        that message (vLLM's and transformers' semantics; needs add_generation_prompt False). The fallback format
        has no place for tools or extra variables. Raises ChatTemplateError."""
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to no messages")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        extra = dict(template_kwargs or {})
        clash = sorted(k for k in extra if k in RESERVED_VARIABLES or k in self.special_tokens or k.startswith("_"))
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(clash)}")
        if self._compiled is None:
            text = render_fallback(messages, add_generation_prompt)
        else:
            plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
            try:
                text = str(self._compiled.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                                 tools=list(tools) if tools else None, documents=None,
                                                 **self.special_tokens, **extra))
            except Exception as e:  # the template's raise_exception(), sandbox violations, any other template bug
                raise ChatTemplateError(str(e) or type(e).__name__) from None
        return _cut_after_final(text, messages[-1]) if continue_final_message else text


RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Template variables `render` sets itself (chat_template_kwargs may not replace them)."""


def loops_over_content(tree: Any) -> bool:
    """Whether a parsed template has a `for` loop over a `content` item or attribute (`message['content']`,
    `message.content`, through filters and slices) or over a variable named `content`."""
    from jinja2 import nodes

    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, (nodes.Filter, nodes.Test)) or (isinstance(it, nodes.Getitem)
                                                              and isinstance(it.arg, nodes.Slice)):
            it = it.node
        if (isinstance(it, nodes.Getattr) and it.attr == "content") or \
                (isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content") or \
                (isinstance(it, nodes.Name) and it.name == "content"):
            return True
    return False


def _cut_after_final(text: str, final: Mapping[str, Any]) -> str:
    """`text` up to the end of the final message's content (its last occurrence): what follows it (an end-of-turn
    token, a newline) would close the message the model is asked to continue."""
    content = final.get("content")
    if isinstance(content, list) and content:  # text parts as the template saw them: the message ends with the last
        content = content[-1].get("text") if isinstance(content[-1], Mapping) else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    for needle in (content, content.strip()):  # templates that strip the content render the second
        end = text.rfind(needle)
        if end >= 0:
            return text[: end + len(needle)]
    raise ChatTemplateError("continue_final_message: the final message's content is not in the rendered prompt")


def _compile(source: str) -> Any:
    """A jinja2 Template in transformers' sandboxed environment; ModelLoadError if it cannot be compiled."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with torch and transformers
        raise ModelLoadError("the model has a chat template: rendering it needs jinja2") from None
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < MIN_JINJA2:
        raise ModelLoadError(f"jinja2 {jinja2.__version__} has sandbox escapes; chat templates need >= 3.1.6")

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace() without underscore names (no reaching CPython internals through it)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: no underscore names")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **kw: dict(*a, **kw), namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"the chat template does not compile: {e}") from None


__all__ = ["ChatTemplate", "ChatTemplateError", "render_fallback"]
