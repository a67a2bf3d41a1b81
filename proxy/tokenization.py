"""Prompt tokenization and chat templating for the proxy (the `tokenizers` library; no transformers, no torch).

Loaded from a Hugging Face model directory:
  - `tokenizer.json` (required for text prompts),
  - the chat template: `chat_template` in `tokenizer_config.json` (a string, or a list of `{name, template}` where
    `default` wins), else a `chat_template.jinja` file. Rendered with jinja2 in a sandbox, as transformers does,
    with `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`.
  - no template (or no jinja2): the fallback format below.

Fallback chat format (documented contract; one block per message, then the generation prompt):

    <|system|>\nYou are terse.\n<|user|>\nHi\n<|assistant|>\n

Text from a template already carries its special tokens, so it is encoded with `add_special_tokens=False`;
completion prompts and the fallback format are encoded with the tokenizer's own special-token rules.

Threads: the app calls `encode*` from a worker thread, never on the event loop. `tokenizers`' `encode` holds the
GIL for the whole call (a 4 MB prompt stalled every other request for seconds), `encode_batch` releases it, so
encoding goes through `encode_batch([text])`. `max_chars(n)` bounds the text length that can still fit in n
tokens, so a huge prompt is refused before it is tokenized at all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from proxy.errors import bad_request
from proxy.openai_schema import ChatMessage

FALLBACK_GENERATION_PROMPT = "<|assistant|>\n"


def render_fallback(messages: Sequence[ChatMessage]) -> str:
    """The fallback chat format: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + FALLBACK_GENERATION_PROMPT


def _token_text(value: Any) -> str:
    """`bos_token` / `eos_token` in tokenizer_config.json are a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _select_template(raw: Any) -> str | None:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


class _JinjaTemplate:
    """A compiled chat template (jinja2 sandbox, the same environment options transformers uses)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._special_tokens = special_tokens

    def render(self, messages: Sequence[ChatMessage]) -> str:
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            **self._special_tokens,
        )


class PromptTokenizer:
    """Encodes prompts and decodes single tokens (for logprobs). Owned by the app; thread-safe for reads."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tokenizer
        self._longest_token: int | None = None
        self._template: _JinjaTemplate | None = None
        if chat_template is not None:
            try:
                self._template = _JinjaTemplate(chat_template, special_tokens or {})
            except ImportError:  # jinja2 absent: documented fallback format
                self._template = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> PromptTokenizer:
        """Load `tokenizer.json` and the chat template (if any) from a model directory."""
        root = Path(model_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        tokenizer = Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        template = _select_template(cfg.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        specials = {"bos_token": _token_text(cfg.get("bos_token")), "eos_token": _token_text(cfg.get("eos_token"))}
        return cls(tokenizer, template, specials)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode(self, text: str) -> list[int]:
        """A completion prompt, with the tokenizer's special-token rules (e.g. a BOS post-processor)."""
        return self._encode(text, True)

    def max_chars(self, num_tokens: int) -> int:
        """An upper bound on the characters `num_tokens` tokens can cover: the longest token (added tokens
        included) times 4 (for normalizers that fold several characters into one), times num_tokens, plus slack.
        Text longer than this cannot fit and is refused without tokenizing it."""
        if self._longest_token is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._longest_token = max((len(t) for t in vocab), default=1)
        return num_tokens * self._longest_token * 4 + 1024

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The chat prompt text: the model's template, else the fallback format. A template error is a 400."""
        if self._template is None:
            return render_fallback(messages)
        try:
            return self._template.render(messages)
        except Exception as exc:  # jinja2 errors and the template's own raise_exception()
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self._encode(self.render_chat(messages), self._template is None)

    def token_text(self, token_id: int) -> str:
        """The text of one token (for logprobs); may be a replacement character for a partial UTF-8 byte."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def visible_text(self, token_id: int) -> str:
        """What one token adds to the output text (special tokens add nothing): for logprob text offsets."""
        return str(self._tok.decode([token_id], skip_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids to text as the workers detokenize output (special tokens skipped): for `echo`."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))
