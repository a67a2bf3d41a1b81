"""What a request's output must match: `StructuredOutput(kind, spec)`, plain text on both sides of the wire.

kinds (the `spec` text of each):
  json          a JSON schema (JSON text)
  json_object   any JSON object ("" spec)
  regex         a regular expression the whole output must match
  choice        a JSON list of strings: the output is exactly one of them
  grammar       an EBNF grammar (xgrammar's GBNF dialect, `root` rule) or a Lark grammar
  tool_calls    a tool-call request (engine.structured.tools: JSON {"format", "tools", "tool_choice",
                "reasoning", "parallel_tool_calls"})
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"structured output spec must be text, got {type(self.spec).__name__}")
        if self.kind not in ("json_object",) and not self.spec:
            raise InvalidRequestError(f"structured output of kind {self.kind!r} needs a non-empty spec")
