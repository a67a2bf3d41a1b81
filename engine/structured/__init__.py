"""Structured output: constrain sampling to a JSON schema, regex, choice, EBNF grammar or a tool-call format.

    spec.py      StructuredOutput (kind + text): what a request asks for; plain data, no torch, no xgrammar
    grammar.py   GrammarCache: compiles a spec once (xgrammar's GrammarCompiler over the model's tokenizer, an LRU
                 cache in front); a malformed spec is an InvalidRequestError naming the problem
    tools.py     the structural tag of a family's tool-call syntax (tool_choice required / named / auto)
    matchers.py  StructuredOutputs: one matcher per request (the grammar state), advanced as tokens are accepted;
                 fills one token bitmask per step for the constrained rows and applies it to the logits

Where compilation happens: on the worker that first sees the request (engine.core.EngineCore.new_request), the
prefill worker under PD and the decode worker colocated; both have the tokenizer xgrammar needs. The proxy does not
import xgrammar (it imports torch): it checks shapes only, so a malformed schema comes back from the first worker as
INVALID_ARGUMENT, which the proxy answers with a 400 naming the problem.
"""

from __future__ import annotations

from hybridpd.engine.structured.spec import KINDS, StructuredOutput

__all__ = ["KINDS", "StructuredOutput"]
