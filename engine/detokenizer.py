"""Incremental detokenization: a request's output text grows by decoding only a short window of its newest tokens
each step, instead of decoding all of them again (which made a request's detokenization O(n^2) in its length).

    ids:   t0 t1 ... t[prefix] ... t[read] ... t[n-1]
                     |<- window ->|<- new ->|
    prefix_text = decode(ids[prefix:read])       what the window already contributed
    window_text = decode(ids[prefix:n])
    new text    = window_text[len(prefix_text):]  held back while it ends in an incomplete UTF-8 character (U+FFFD)

Decoding a window that starts a few tokens back keeps what tokenizers do at token boundaries (a leading space, a
multi-byte character split over tokens) the same as in a full decode. `finish()` flushes what was held back, so the
concatenation of every step's new text is the final text. One instance per request, step thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

WINDOW = 6
"""Tokens of context decoded before the new ones (enough for byte-level BPE and SentencePiece boundaries)."""


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._prefix = 0  # start of the window (token index)
        self._read = 0  # tokens whose text is in `text`
        self._seen = 0  # tokens looked at (the rest may be held back)
        self._pieces: list[str] = []
        self._text = ""

    @property
    def text(self) -> str:
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    @property
    def num_seen(self) -> int:
        """Tokens given so far (their text may be partly held back)."""
        return self._seen

    def update(self, ids: Sequence[int]) -> str:
        """Take the request's tokens so far (a prefix of them was given before); return the text that became
        final with them ("" while an incomplete character is held back)."""
        if len(ids) <= self._seen:
            return ""
        self._seen = len(ids)
        return self._advance(ids, final=False)

    def finish(self, ids: Sequence[int]) -> str:
        """The last tokens are in: return everything still held back (even an incomplete character, as a full
        decode would show it)."""
        self._seen = len(ids)
        return self._advance(ids, final=True)

    def _advance(self, ids: Sequence[int], final: bool) -> str:
        if self._read >= len(ids):
            return ""
        prefix_text = self._tok.decode(ids[self._prefix:self._read], skip_special_tokens=self._skip)
        window_text = self._tok.decode(ids[self._prefix:], skip_special_tokens=self._skip)
        if not final and (len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd")):
            return ""  # nothing printable yet, or a character still incomplete
        new = window_text[len(prefix_text):]
        self._read = len(ids)
        self._prefix = max(0, self._read - WINDOW)
        if new:
            self._pieces.append(new)
        return new
