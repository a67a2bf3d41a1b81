"""The proxy's admission, request-limit, API-key, HTTP and decode-failover flags, shared by `hybridpd proxy` and
`hybridpd serve`.

`add_proxy_limit_args(parser)` adds them; `proxy_limits_from_args(args)` turns them into `ProxyConfig` keyword
arguments (`admission`, `request_limits`, `http`, `api_keys`, `inter_token_timeout_s`). `serve` knows its decode
workers' engine config, so it passes `derived_max_seqs` (QUEUE_DEPTH x --max-num-seqs x --num-decode) as the
sequence budget unless --admission-max-seqs is given.
"""

from __future__ import annotations

import argparse
from typing import Any

QUEUE_DEPTH = 4  # admitted sequences per running slot of a decode worker: one running batch, three waiting


def add_proxy_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission (the proxy's budget of admitted work)")
    g.add_argument(
        "--admission-max-seqs",
        type=int,
        default=None,
        metavar="N",
        help="sequences in flight across the cluster (a request holds n x prompts); beyond it requests "
        "wait briefly, then get 503 + Retry-After (default: serve: 4 x --max-num-seqs x "
        "--num-decode; proxy: 256 per decode worker)",
    )
    g.add_argument(
        "--admission-max-queued-prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens admitted and not yet past their first output token (default: 64 x "
        "max model length per prefill worker)",
    )
    g.add_argument(
        "--admission-max-tokens-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="sum of prompt + max_tokens over admitted sequences (default: no such budget)",
    )
    g.add_argument(
        "--admission-tenant-share",
        type=float,
        default=0.5,
        metavar="F",
        help="fraction of each budget one client (API key, or address without keys) may hold",
    )
    g.add_argument(
        "--admission-queue-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds a request may wait for room before its 503",
    )
    g.add_argument("--admission-max-waiting", type=int, default=64, metavar="N", help="requests that may wait")
    g.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="several client keys with limits, one per line: NAME KEY [max_concurrency=N] [tokens_per_minute=N]",
    )
    g.add_argument(
        "--key-max-concurrency",
        type=int,
        default=0,
        metavar="N",
        help="default sequences in flight per key of --api-keys-file (0: unlimited)",
    )
    g.add_argument(
        "--key-tokens-per-minute",
        type=int,
        default=0,
        metavar="N",
        help="default prompt + max_tokens per minute per key of --api-keys-file (0: unlimited)",
    )
    g = p.add_argument_group("request limits (400 beyond them)")
    g.add_argument("--max-stop-strings", type=int, default=32, metavar="N", help="stop strings per request")
    g.add_argument("--max-logit-bias", type=int, default=1024, metavar="N", help="logit_bias entries per request")
    g.add_argument("--max-prompts", type=int, default=256, metavar="N", help="prompts per completion request")
    g.add_argument(
        "--max-schema-depth",
        type=int,
        default=64,
        metavar="N",
        help="nesting depth (JSON objects and arrays) of a structured-output or tool-parameter JSON schema",
    )
    g.add_argument(
        "--max-schema-properties",
        type=int,
        default=1024,
        metavar="N",
        help="optional properties of one object in a structured-output or tool-parameter JSON schema; 8 x N: "
        "the properties of all of a field's schemas (a request's tools together)",
    )
    g.add_argument(
        "--max-grammar-chars",
        type=int,
        default=65536,
        metavar="N",
        help="characters of a structured-output regex or grammar",
    )
    g = p.add_argument_group("HTTP hardening")
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a client has to send a request's headers (slow clients are dropped)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client has to send a request's body after its headers (then 408)",
    )
    g.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client may leave a response unread (the proxy's writes blocked) before it is dropped and "
        "its request aborted",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        metavar="N",
        help="open client connections; more are closed on accept (keep under `ulimit -n`)",
    )
    g.add_argument("--keep-alive-timeout", type=int, default=5, metavar="S", help="idle keep-alive seconds")
    g = p.add_argument_group("decode failover")
    g.add_argument(
        "--inter-token-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds a decode worker may send nothing mid-stream before the proxy gives it up for that "
        "request (frozen, or the request stuck there): the request resumes on another decode worker "
        "with no token repeated or lost, or fails with 503 when none is left (default: 120, above a step that "
        "compiles GPU kernels for a new shape; 0: no such deadline)",
    )


def proxy_limits_from_args(args: argparse.Namespace, derived_max_seqs: int | None = None) -> dict[str, Any]:
    """`ProxyConfig` keyword arguments; raises ValueError for a bad value or keys file."""
    from hybridpd.proxy.api_keys import load_keys_file
    from hybridpd.proxy.config import AdmissionLimits, HttpLimits, RequestLimits

    if not args.inter_token_timeout >= 0:
        raise ValueError(f"--inter-token-timeout must be >= 0, got {args.inter_token_timeout}")
    keys = (
        ()
        if args.api_keys_file is None
        else load_keys_file(args.api_keys_file, args.key_max_concurrency, args.key_tokens_per_minute)
    )
    return {
        "api_keys": keys,
        "admission": AdmissionLimits(
            max_num_seqs=args.admission_max_seqs or derived_max_seqs,
            max_queued_prompt_tokens=args.admission_max_queued_prompt_tokens,
            max_tokens_in_flight=args.admission_max_tokens_in_flight,
            max_waiting=args.admission_max_waiting,
            queue_timeout_s=args.admission_queue_timeout,
            max_tenant_share=args.admission_tenant_share,
        ),
        "request_limits": RequestLimits(
            max_stop_strings=args.max_stop_strings,
            max_logit_bias=args.max_logit_bias,
            max_prompts=args.max_prompts,
            max_schema_depth=args.max_schema_depth,
            max_grammar_chars=args.max_grammar_chars,
            max_schema_properties=args.max_schema_properties,
        ),
        "http": HttpLimits(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
            keep_alive_timeout_s=args.keep_alive_timeout,
            send_timeout_s=args.send_timeout,
        ),
        "inter_token_timeout_s": args.inter_token_timeout,
    }


def serve_max_seqs(args: argparse.Namespace) -> int | None:
    """The sequence budget `serve` derives from its decode workers' engine flags (None: unknown)."""
    per_worker = getattr(args, "max_num_seqs", None)
    return QUEUE_DEPTH * per_worker * args.num_decode if per_worker else None
