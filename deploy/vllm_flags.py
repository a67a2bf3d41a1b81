"""vLLM's spellings of the flags an operator copies from a `vllm serve` command line. Those that mean here what they
mean in vLLM are honoured; those naming a feature hybridpd does not have are refused with a message naming the flag,
before anything starts. None is silently ignored.

    honoured   --enable-prefix-caching / --no-enable-prefix-caching    = --prefix-caching / --no-prefix-caching
               --revision REV, --tokenizer-revision REV, --download-dir DIR   a Hugging Face model id's snapshot
               --enable-chunked-prefill                                 chunked prefill is always on here
               --disable-log-requests, --disable-log-stats              neither is logged here
               --kv-cache-dtype auto                                    the cache holds the model's dtype
               --pipeline-parallel-size 1, --data-parallel-size 1       (replicas: --num-decode, --colocated)
               --enable-auto-tool-choice, --tool-call-parser qwen3_coder    tool calling is always on, in the XML
                                                                        format of both families' chat templates
               --max-model-len 32k | 32K | auto | -1, --max-num-batched-tokens 8k, --kv-cache-memory-bytes 4G
                                                                        vLLM's human-readable integers (k = 1000,
                                                                        K = 1024, ...); auto / -1: the longest
                                                                        max_model_len the cache holds (auto-fit)
               --dtype half | float                                     float16 | float32
    refused    --no-enable-chunked-prefill, --kv-cache-dtype other than auto, --quantization,
               --pipeline-parallel-size or --data-parallel-size above 1, another --tool-call-parser,
               --reasoning-parser, --enable-lora, --speculative-config
"""

from __future__ import annotations

import argparse
import re

from hybridpd.engine.errors import HybridPDError

PREFIX_CACHING_ALIAS = "--enable-prefix-caching"
"""vLLM's name of --prefix-caching (its negation --no-enable-prefix-caching comes with it)."""

TOOL_CALL_PARSERS = ("qwen3_coder",)
"""vLLM's names of the tool-call format the proxy parses (proxy/tools.py: <tool_call><function=NAME>...)."""

_REFUSED = {
    "quantization": "quantized checkpoints are not supported (both families load bf16/fp32 weights)",
    "reasoning_parser": "reasoning parsers are not implemented (the text is returned as the model wrote it)",
    "enable_lora": "LoRA adapters are not supported",
    "speculative_config": "speculative decoding is not implemented",
}


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
"""vLLM's grammar of a suffixed integer: digits, a decimal part, one suffix (no sign, exponent, inf or nan)."""


def human_readable_int(value: str) -> int:
    """An integer as vLLM's flags take it: plain, or a number with a decimal (k m g t: powers of 1000, decimals
    allowed: 25.6k = 25600) or binary (K M G T: powers of 1024, whole numbers only) suffix."""
    text = value.strip()
    suffixed = _SUFFIXED.fullmatch(text)
    if suffixed:
        number, suffix = suffixed.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." not in number:
            return int(number) * _BINARY[suffix]
        raise argparse.ArgumentTypeError(
            f"not an integer: {value!r} (decimals only with k, m, g, t: {number}{suffix.lower()}?)"
        )
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r} (e.g. 4096, 32k, 32K)") from None


def human_readable_int_or_auto(value: str) -> int:
    """`human_readable_int`, or auto / -1: -1 (vLLM's --max-model-len auto: the longest length the memory holds)."""
    return -1 if value.strip().lower() in ("auto", "-1") else human_readable_int(value)


class UnsupportedFlagError(HybridPDError):
    """A vLLM flag naming something hybridpd does not do."""


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """The vLLM spellings beside the engine flags (the prefix-caching alias is added with its flag)."""
    g = parser.add_argument_group("vLLM spellings (honoured where they mean the same here; refused otherwise)")
    g.add_argument("--revision", default=None, help="a Hugging Face model id's revision (branch, tag or commit)")
    g.add_argument("--tokenizer-revision", default=None, help="the revision of --tokenizer's model id")
    g.add_argument("--download-dir", default=None, metavar="DIR", help="Hugging Face cache directory for model ids")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="always on here (a --no- form is refused)")
    g.add_argument("--disable-log-requests", action="store_true", help="requests are not logged here (a no-op)")
    g.add_argument("--disable-log-stats", action="store_true", help="periodic stats are not logged here (a no-op)")
    g.add_argument("--kv-cache-dtype", default="auto", help="auto only: the cache holds the model's dtype")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only (use --tensor-parallel-size)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="1 only (replicas: serve --num-decode / --colocated)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' is always available here (a no-op)")
    g.add_argument("--tool-call-parser", default=None,
                   help=f"the tool-call format: {', '.join(TOOL_CALL_PARSERS)} (what both families' templates use)")
    for name in _REFUSED:
        flag = "--" + name.replace("_", "-")
        if name == "enable_lora":
            g.add_argument(flag, action="store_true", help=f"refused: {_REFUSED[name]}")
        else:
            g.add_argument(flag, default=None, help=f"refused: {_REFUSED[name]}")


def check_vllm_args(args: argparse.Namespace) -> None:
    """Refuse the vLLM flags that name what hybridpd does not do (UnsupportedFlagError naming the flag)."""
    get = vars(args).get  # (a parser without these flags: their defaults)
    for name, why in _REFUSED.items():
        if get(name) not in (None, False):
            raise UnsupportedFlagError(f"--{name.replace('_', '-')}: {why}")
    if get("enable_chunked_prefill") is False:
        raise UnsupportedFlagError("--no-enable-chunked-prefill: chunked prefill is always on here "
                                   "(--max-num-batched-tokens sets the chunk)")
    if get("kv_cache_dtype", "auto") != "auto":
        raise UnsupportedFlagError(f"--kv-cache-dtype {get('kv_cache_dtype')}: only auto (the model's dtype)")
    for name, instead in (("pipeline_parallel_size", "--tensor-parallel-size"),
                          ("data_parallel_size", "replicas: serve --num-decode, or --colocated")):
        if get(name, 1) != 1:
            raise UnsupportedFlagError(f"--{name.replace('_', '-')} {get(name)}: only 1 ({instead})")
    parser = get("tool_call_parser")
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise UnsupportedFlagError(f"--tool-call-parser {parser}: the proxy parses {', '.join(TOOL_CALL_PARSERS)} "
                                   "(<tool_call><function=NAME>, both families' format)")


__all__ = ["PREFIX_CACHING_ALIAS", "UnsupportedFlagError", "add_vllm_args", "check_vllm_args"]
