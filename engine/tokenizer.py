"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` that also knows the model's eos ids and chat template.

Chat template: engine.chat_template, the one renderer (shared with the proxy): where the template comes from, the
sandbox, the fallback format without one. `DEFAULT_CHAT_TEMPLATE` (ChatML) is the template the built-in checkpoints
ship in their tokenizer_config.json:

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... [<|im_start|>assistant\\n]

`build_byte_level_tokenizer` / `write_tokenizer_files` make the byte-level tokenizer of the built-in random
checkpoints: ids 0..255 are the bytes, then `<|endoftext|>` (eos, 256), `<|im_start|>`, `<|im_end|>`, then
`<|reserved_N|>` fillers so that every model id decodes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpd.engine.chat_template import ChatTemplate, read_json, token_text
from hybridpd.engine.errors import ModelLoadError
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


class Tokenizer:
    """Encode/decode text, eos ids, chat template. Immutable after construction; safe to share across threads."""

    def __init__(
        self,
        backend: _Backend,
        eos_token_ids: Sequence[int] = (),
        chat_template: ChatTemplate | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.chat_template = chat_template if chat_template is not None else ChatTemplate(None)
        self.bos_token_id = bos_token_id

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) plus tokenizer_config.json / chat_template.jinja / config.json /
        generation_config.json (optional) from a model directory."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"model directory {str(path)!r} has no tokenizer.json")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ModelLoadError(f"cannot load {tok_file}: {e}") from None
        tcfg = read_json(root / "tokenizer_config.json")
        model_cfg = read_json(root / "config.json")
        text_cfg = model_cfg.get("text_config")
        eos: list[int] = []
        eos_name = token_text(tcfg.get("eos_token"))
        eos_id = backend.token_to_id(eos_name) if eos_name is not None else None
        if eos_id is not None:
            eos.append(eos_id)
        text = text_cfg if isinstance(text_cfg, dict) else {}
        for src in (model_cfg, text, read_json(root / "generation_config.json")):
            eos += [i for i in _ids(src.get("eos_token_id")) if i not in eos]
        bos_name = token_text(tcfg.get("bos_token"))
        bos = backend.token_to_id(bos_name) if bos_name is not None else None
        return cls(backend, eos, ChatTemplate.from_dir(root, tcfg), bos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render messages ([{"role", "content"}]) with `tools` (OpenAI tool objects) to the prompt text
        (`ChatTemplate.render` for the other arguments). Raises ChatTemplateError."""
        return self.chat_template.render(messages, add_generation_prompt, tools=tools, template_kwargs=template_kwargs,
                                         continue_final_message=continue_final_message)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The prompt's token ids (special tokens added only when the template does not write them itself)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs, continue_final_message)
        return self.encode(text, add_special_tokens=not self.chat_template.carries_special_tokens)


# ----------------------------------------------------------------------------------------------------------------
# the built-in byte-level tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def build_byte_level_tokenizer(vocab_size: int) -> _Backend:
    """Byte-level BPE without merges: token id b is byte b; special tokens and fillers up to `vocab_size`."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for the byte-level tokenizer")
    byte_map = bytes_to_unicode()
    backend = _Backend(models.BPE(vocab={byte_map[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    fillers = [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(SPECIAL_TOKENS))]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *fillers)])
    return backend


def write_tokenizer_files(out_dir: str | Path, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (eos `<|endoftext|>`, ChatML chat template)."""
    root = Path(out_dir)
    build_byte_level_tokenizer(vocab_size).save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["DEFAULT_CHAT_TEMPLATE", "Tokenizer", "build_byte_level_tokenizer", "write_tokenizer_files"]
