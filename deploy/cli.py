"""The `hybridpd` command line: serve, worker, proxy, generate, init-model, bench.

Bad input ends with a one-line message on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from hybridpd.deploy.cli_parser import SuggestingParser
from hybridpd.deploy.engine_flags import add_engine_args, engine_config_from_args
from hybridpd.engine.errors import HybridPDError

FAMILIES = ("nemotron_h", "qwen3_5", "qwen3_5_moe")


def cmd_init_model(args: argparse.Namespace) -> int:
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    overrides = json.loads(args.overrides) if args.overrides else {}
    if args.preset:
        from hybridpd.engine.models.checkpoint import preset

        args.family, base = preset(args.preset)
        overrides = {**base, **overrides}
    if not args.family:
        raise HybridPDError("init-model needs --family or --preset")
    path = write_random_checkpoint(args.out, args.family, seed=args.seed, weights=not args.no_weights, **overrides)
    what = "config + tokenizer (serve it with --load-format dummy)" if args.no_weights else "random-weight"
    print(f"wrote {what} {args.family} checkpoint to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from hybridpd.engine.llm import LLM
    from hybridpd.engine.sampling_params import SamplingParams

    llm = LLM(config=engine_config_from_args(args))  # every engine flag, as `worker` and `serve` pass them
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, stop=tuple(args.stop or ()))
    prompts = args.prompt or ["Hello, hybrid world"]
    try:
        for out in llm.generate(prompts, params):
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              "num_cached_tokens": out.num_cached_tokens}))
    finally:
        llm.shutdown()  # tensor-parallel ranks stopped and the group left before the interpreter tears down
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridpd")
    except PackageNotFoundError:
        return "unknown"


def _with_defaults(sub: argparse._SubParsersAction) -> None:
    """Every subcommand's --help shows each flag's default."""
    add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        kw.setdefault("description", kw.get("help"))
        return add(name, **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="hybridpd", description="Disaggregated prefill/decode for hybrid LLMs")
    parser.add_argument("--version", action="version", version=f"hybridpd {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _with_defaults(sub)

    p = sub.add_parser("init-model", help="write a small random-weight HF-format hybrid checkpoint")
    p.add_argument("--family", default=None, choices=FAMILIES)
    p.add_argument("--preset", default=None, choices=("nemotron-h-8b", "qwen3.5-9b", "nemotron-3-nano-30b-a3b"),
                   help="full-size public shape with random weights (fp32 on disk, ~4 bytes per parameter)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--overrides", default=None, help="JSON dict of config overrides (e.g. hidden_size)")
    p.add_argument("--no-weights", action="store_true",
                   help="write config.json and the tokenizer only; engines draw random weights on their device with "
                        "--load-format dummy (full-size presets without a 16-32 GB file)")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("generate", help="offline generation with the colocated engine")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: one fixed prompt)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=cmd_generate)

    from hybridpd.deploy import commands

    commands.add_serving_commands(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpcore"):  # one INFO line per HTTP request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "enforce_eager", False):
        os.environ["HYBRIDPD_ENFORCE_EAGER"] = "1"  # read by engine.runner.ModelRunner (inherited by workers)
    try:
        return int(args.func(args) or 0)
    except HybridPDError as e:
        print(f"hybridpd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
