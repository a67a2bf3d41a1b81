"""Compile a StructuredOutput into an xgrammar CompiledGrammar, once per spec.

JSON has fixed whitespace (`{"a": 1, "b": 2}`, as `json.dumps` writes it): valid JSON that a model cannot pad with
whitespace until max_tokens. The compiler needs the model's vocabulary (xgrammar's TokenizerInfo: every token's
bytes, the vocabulary type and the logit width), built once from the engine's `tokenizers` backend. Compiled
grammars are kept in an LRU cache keyed by the spec (`capacity` entries); xgrammar's own compiler cache sits behind
it. Errors (a malformed schema, regex or grammar) are raised as InvalidRequestError naming what is wrong; they are
not cached.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.structured.spec import StructuredOutput

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def tokenizer_info(backend: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of a `tokenizers.Tokenizer` whose model emits `vocab_size` logits."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


def _message(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _CPP_PREFIX.sub("", text)


class GrammarCache:
    """Thread-safe: the step thread and request validation may compile at once."""

    def __init__(self, info: Any, capacity: int = 256, max_threads: int = 4) -> None:
        import xgrammar as xgr

        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self.capacity = capacity
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.json_allowed = _without_control_characters(info)
        """Bitmask words [ceil(vocab / 32)] of tokens that hold no control character (bytes < 0x20): xgrammar lets
        them into JSON strings raw, which JSON forbids (and json.loads refuses); JSON rows are ANDed with it."""

    def get(self, spec: StructuredOutput) -> Any:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
        what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "tool_calls": "tool-call format"}[spec.kind]
        try:
            return self._dispatch(spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / pydantic errors
            raise InvalidRequestError(f"invalid {what} for structured output: {_message(e)}") from None

    def _dispatch(self, spec: StructuredOutput) -> Any:
        c = self.compiler
        if spec.kind == "json":
            schema = _json(spec.spec, "JSON schema")
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("invalid JSON schema for structured output: a schema must be an object")
            return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_grammar(choice_grammar(_json(spec.spec, "choice list")))
        if spec.kind == "grammar":
            return self._grammar(spec.spec)
        from hybridpd.engine.structured.tools import tool_call_tag

        return c.compile_structural_tag(tool_call_tag(_json(spec.spec, "tool-call request")))

    def _grammar(self, text: str) -> Any:
        """EBNF first; a grammar that is not EBNF but compiles as Lark is taken as Lark (vLLM accepts both)."""
        try:
            return self.compiler.compile_grammar(text)
        except Exception as ebnf_error:  # noqa: BLE001
            if "::=" in text:
                raise
            try:
                return self.compiler.compile_lark(text)
            except Exception:  # noqa: BLE001 - report the EBNF parser's complaint
                raise ebnf_error from None


def _without_control_characters(info: Any) -> Any:
    import torch

    vocab = info.vocab_size
    allowed = torch.ones(-(-vocab // 32) * 32, dtype=torch.bool)
    special = set(info.special_token_ids) | set(info.stop_token_ids)
    for tid, piece in enumerate(info.decoded_vocab[:vocab]):
        if tid not in special and any(b < 0x20 for b in piece):
            allowed[tid] = False
    words = (allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bit pattern as int32


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"invalid {what} for structured output: not valid JSON ({e})") from None


def choice_grammar(choices: Any) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("invalid choice for structured output: must be a non-empty list of non-empty "
                                  "strings")
    # literal characters, not \u escapes: the grammar reads an escaped surrogate pair as two characters
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


__all__ = ["GrammarCache", "choice_grammar", "tokenizer_info"]
