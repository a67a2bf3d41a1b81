"""Prompt tokenization and chat templating for the proxy (the `tokenizers` library; no transformers, no torch).

Loaded from a Hugging Face model directory:
  - `tokenizer.json` (required for text prompts),
  - the chat template, rendered by engine.chat_template (the one renderer, shared with the engine's Tokenizer):
    `chat_template.jinja` / `additional_chat_templates/`, else `chat_template` in `tokenizer_config.json` (a string,
    or a list of `{name, template}` where `default` wins); jinja2 in a sandbox as transformers does, with
    `messages`, `add_generation_prompt=True` and the special tokens (`bos_token`, `eos_token`, ...).
  - no template: the fallback format (documented contract; one block per message, then the generation prompt):

    <|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n

Text from a template already carries its special tokens, so it is encoded with `add_special_tokens=False`;
completion prompts and the fallback format are encoded with the tokenizer's own special-token rules.

Threads: the app calls `encode*` from a worker thread, never on the event loop. `tokenizers`' `encode` holds the
GIL for the whole call (a 4 MB prompt stalled every other request for seconds), `encode_batch` releases it, so
encoding goes through `encode_batch([text])`. `max_chars(n)` bounds the text length that can still fit in n
tokens, so a huge prompt is refused before it is tokenized at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpd.engine import chat_template
from hybridpd.proxy.errors import bad_request
from hybridpd.proxy.openai_schema import ChatMessage, ChatRender
from tokenizers import Tokenizer


def render_fallback(messages: Sequence[ChatMessage]) -> str:
    """The fallback chat format: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    return chat_template.render_fallback(_plain(messages))


def _plain(messages: Sequence[ChatMessage], content_parts: bool = False) -> list[dict[str, Any]]:
    return [m.as_dict(content_parts) for m in messages]


def _template(root: Path, override: str | None) -> chat_template.ChatTemplate:
    if override is None:
        return chat_template.ChatTemplate.from_dir(root)
    path = Path(override)
    source = path.read_text(encoding="utf-8") if path.is_file() else override
    if source is override and "{{" not in source and "{%" not in source:
        raise FileNotFoundError(f"chat template {override!r}: no such file (nor template text)")
    config = chat_template.read_json(root / "tokenizer_config.json")
    return chat_template.ChatTemplate(source, chat_template.special_tokens(config))


class PromptTokenizer:
    """Encodes prompts and decodes single tokens (for logprobs). Owned by the app; thread-safe for reads."""

    def __init__(self, tokenizer: Tokenizer, template: chat_template.ChatTemplate | None = None) -> None:
        self._tok = tokenizer
        self._longest_token: int | None = None
        self._template = template if template is not None else chat_template.ChatTemplate(None)

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> PromptTokenizer:
        """Load `tokenizer.json` and the chat template (if any) from a model directory; `chat_template` (a file,
        or the template text itself when no such file exists) replaces the model's."""
        root = Path(model_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        return cls(Tokenizer.from_file(str(tok_file)), _template(root, chat_template))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template.has_template

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode(self, text: str) -> list[int]:
        """A completion prompt, with the tokenizer's special-token rules (e.g. a BOS post-processor)."""
        return self._encode(text, True)

    def encode_plain(self, text: str) -> list[int]:
        """Without special tokens (`/tokenize` with add_special_tokens false)."""
        return self._encode(text, False)

    def max_chars(self, num_tokens: int) -> int:
        """An upper bound on the characters `num_tokens` tokens can cover: the longest token (added tokens
        included) times 4 (for normalizers that fold several characters into one), times num_tokens, plus slack.
        Text longer than this cannot fit and is refused without tokenizing it."""
        if self._longest_token is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._longest_token = max((len(t) for t in vocab), default=1)
        return num_tokens * self._longest_token * 4 + 1024

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None,
                    render: ChatRender | None = None) -> str:
        """The chat prompt text: the model's template (given `tools`, OpenAI tool objects, and `render`'s
        rendering fields), else the fallback format. A template error is a 400."""
        r = render or ChatRender()
        try:
            plain = _plain(messages, self._template.content_format == "openai")
            return self._template.render(plain, r.add_generation_prompt, tools=tools,
                                         template_kwargs=dict(r.template_kwargs),
                                         continue_final_message=r.continue_final_message)
        except chat_template.ChatTemplateError as exc:  # jinja2 errors and the template's own raise_exception()
            param = "chat_template_kwargs" if str(exc).startswith("chat_template_kwargs") else "messages"
            raise bad_request(f"the chat template rejected the messages: {exc}", param=param) from None

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self.encode_rendered(self.render_chat(messages))

    def encode_rendered(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `render_chat`'s text; special tokens added as asked, else only when the text was not
        rendered by a template (which writes its own)."""
        add = not self._template.carries_special_tokens if add_special_tokens is None else add_special_tokens
        return self._encode(text, add)

    def token_text(self, token_id: int) -> str:
        """The text of one token (for logprobs); may be a replacement character for a partial UTF-8 byte."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def visible_text(self, token_id: int) -> str:
        """What one token adds to the output text (special tokens add nothing): for logprob text offsets."""
        return str(self._tok.decode([token_id], skip_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text as the workers detokenize output (special tokens skipped unless asked): for `echo` and
        logprob text offsets."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
