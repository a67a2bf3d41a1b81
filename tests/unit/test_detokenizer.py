"""engine/detokenizer.py against full decodes: for any token sequence, fed in any step sizes, the pieces it returns
concatenate to the full decode once finished; before that, the text is a prefix of it with no incomplete character
at its end; and each step decodes a bounded window, not the whole output (counted)."""

from __future__ import annotations

import pytest
from hybridpd.engine.detokenizer import WINDOW, IncrementalDetokenizer
from hybridpd.engine.tokenizer import Tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):  # type: ignore[no-untyped-def]
    return Tokenizer.from_pretrained(checkpoint_dir("nemotron_attn_mid"))


class Counting:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[no-untyped-def]
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 255), max_size=60), cuts=st.lists(st.integers(1, 5), max_size=60))
def test_incremental_equals_full_decode(tokenizer, ids, cuts) -> None:  # type: ignore[no-untyped-def]
    full = tokenizer.decode(ids)
    d = IncrementalDetokenizer(tokenizer)
    pieces, n, i = [], 0, 0
    while n < len(ids):
        n = min(len(ids), n + (cuts[i % len(cuts)] if cuts else 1))
        i += 1
        pieces.append(d.update(ids[:n]))
        assert full.startswith(d.text) and not d.text.endswith("\ufffd")
    pieces.append(d.finish(ids))
    assert "".join(pieces) == d.text == full


def test_work_per_step_is_bounded(tokenizer) -> None:  # type: ignore[no-untyped-def]
    counting = Counting(tokenizer)
    d = IncrementalDetokenizer(counting)
    ids = list(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40))
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
    d.finish(ids)
    assert d.text == tokenizer.decode(ids)
    assert counting.decoded <= (2 * WINDOW + 2) * (len(ids) + 1)  # O(n), where full decodes would be O(n^2)
