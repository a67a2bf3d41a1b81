"""How much of a request's output text a worker may stream now (decode streams, and the prefill worker's first
token): the same rule on both, so a first token streamed by P and the text D streams after it add up to the text a
colocated D streams.

Text that could still become part of a stop string (the last `longest stop - 1` characters) and an incomplete UTF-8
character at the end (U+FFFD) are held back until the next token, or the end, decides them."""

from __future__ import annotations

from hybridpd.engine.core import EngineCore
from hybridpd.engine.detokenizer import IncrementalDetokenizer
from hybridpd.engine.request import Request


def streamable_end(text: str, sent: int, finished: bool, longest_stop: int) -> int:
    """End (exclusive) of the text that may have been streamed once `text` is the output so far and `sent`
    characters of it went out already."""
    if finished:
        return len(text)
    end = max(sent, len(text) - max(0, longest_stop - 1))
    while end > sent and text[end - 1] == "\ufffd":
        end -= 1  # an incomplete UTF-8 sequence: wait for the next token
    return end


def longest_stop(req: Request) -> int:
    return max((len(s) for s in req.sampling_params.stop), default=0)


def running_text(core: EngineCore, req: Request) -> str:
    """The output text of a request that goes on elsewhere (a prefill worker's "prefilled" request): as it reads
    while the request runs, nothing flushed as at a real end."""
    if req.finish_reason != "prefilled":
        return core.output_text(req)
    if core.tokenizer is None:
        return ""
    detok = req.detokenizer or IncrementalDetokenizer(core.tokenizer, req.sampling_params.skip_special_tokens)
    detok.update(req.output_token_ids)
    return detok.text


def first_text(core: EngineCore, req: Request) -> str:
    """The text streamed with a request's first output token (step thread)."""
    text = running_text(core, req)
    finished = req.finish_reason not in (None, "prefilled")
    return text[: streamable_end(text, 0, finished, longest_stop(req))]
