"""Serving subcommands of the CLI: serve (Ray), worker and proxy (plain processes), bench serve."""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Callable
from typing import Any

from hybridpd.deploy.engine_flags import engine_argv, engine_config_from_args
from hybridpd.deploy.proxy_flags import add_proxy_limit_args, proxy_limits_from_args, serve_max_seqs
from hybridpd.deploy.vllm_flags import human_readable_int_or_auto
from hybridpd.engine.errors import HybridPDError


def _model_max_len(model: str, override: int | None) -> int:
    """--max-model-len checked against the checkpoint's config.json as the engine checks it (too long: an error
    before anything starts), or the checkpoint's own length when not given."""
    from hybridpd.engine.config import resolve_max_model_len

    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the model's config ({e})") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return resolve_max_model_len(override, hf_config, model)


def cmd_worker(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args)
    cfg.validate()  # bad engine flags: refused before torch, the model and the ports
    check_max_decode_share(args.max_decode_share)
    from hybridpd.worker.auth import load_cluster_token, load_tls
    from hybridpd.worker.bootstrap import WorkerOptions, run_worker

    try:
        token = load_cluster_token(args.cluster_token_file)
        tls = load_tls(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    opts = WorkerOptions(role=args.role, host=args.host, port=args.port, metrics_port=args.metrics_port,
                         advertise_host=args.advertise_host, lease_seconds=args.lease_seconds,
                         transfer_policy=args.transfer_policy, pull_timeout_s=args.pull_timeout,
                         model_name=args.model_name, cluster_token=token, tls=tls,
                         prefill_peers=tuple(args.prefill_peer or ()), max_pinned_fraction=args.max_pinned_fraction,
                         max_decode_share=args.max_decode_share,
                         nixl_progress_thread=args.nixl_progress_thread,
                         register_with=tuple(args.register_with or ()), heartbeat_s=args.heartbeat,
                         stall_timeout_s=args.engine_stall_timeout)
    return run_worker(cfg, opts)


class ConfigError(HybridPDError):
    """Bad serving configuration found before anything started (busy port, unreadable secret file)."""


def check_chat_template(value: str | None) -> None:
    """--chat-template: a readable file, or template text (holding `{{` or `{%`)."""
    if value is not None and not os.path.isfile(value) and "{{" not in value and "{%" not in value:
        raise ConfigError(f"--chat-template {value!r}: no such file (nor Jinja template text)")


def check_generation_config(value: str) -> None:
    """--generation-config: auto, vllm, or a directory holding a generation_config.json."""
    if value not in ("auto", "vllm") and not os.path.isfile(os.path.join(value, "generation_config.json")):
        raise ConfigError(f"--generation-config {value!r}: expected auto, vllm or a directory holding a "
                          "generation_config.json")


def check_port_free(host: str, port: int) -> None:
    """Refuse at once (before Ray or any worker starts) when host:port cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn sets: TIME_WAIT is not "busy"
        try:
            s.bind((host, port))
        except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
            why = getattr(e, "strerror", None) or e
            raise ConfigError(f"cannot listen on {host}:{port}: {why} (choose another --port)") from None


def resolve_secrets(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(API key, cluster token) from --api-key-file / env / --api-key and --cluster-token-file / env."""
    from hybridpd.proxy.credentials import resolve_api_key, resolve_cluster_token

    try:
        return (resolve_api_key(args.api_key_file, args.api_key),
                resolve_cluster_token(getattr(args, "cluster_token_file", None)))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def proxy_limits(args: argparse.Namespace, derived_max_seqs: int | None = None) -> dict[str, Any]:
    """The proxy's admission, request-limit, key and HTTP settings from the flags (`deploy.proxy_flags`)."""
    try:
        return proxy_limits_from_args(args, derived_max_seqs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cmd_proxy(args: argparse.Namespace) -> int:
    from hybridpd.proxy.config import ProxyConfig
    from hybridpd.proxy.server import run

    check_port_free(args.host, args.port)
    check_chat_template(args.chat_template)
    check_generation_config(args.generation_config)
    api_key, token = resolve_secrets(args)
    if args.model:
        from hybridpd.engine.model_source import looks_like_model_id, resolve_model

        if args.served_model_name is None and looks_like_model_id(args.model):
            args.served_model_name = args.model
        args.model = resolve_model(args.model)
    if args.tokenizer:
        from hybridpd.engine.model_source import resolve_model

        args.tokenizer = resolve_model(args.tokenizer)
    name = args.served_model_name
    model_name = name or (os.path.basename(os.path.normpath(args.model)) if args.model else "hybridpd")
    if args.model:
        max_len = _model_max_len(args.model, args.max_model_len)
    else:  # auto (-1) or none: 4096; anything else as given (ProxyConfig refuses what is not >= 1)
        max_len = 4096 if args.max_model_len in (None, -1) else args.max_model_len
    try:
        cfg = ProxyConfig(prefill_addrs=tuple(args.prefill or ()), decode_addrs=tuple(args.decode or ()),
                          model_name=model_name, tokenizer_path=args.tokenizer or args.model, model_path=args.model,
                          generation_config=args.generation_config,
                          chat_template=args.chat_template,
                          routing=args.routing, api_key=api_key,
                          max_model_len=max_len, colocated=args.colocated, host=args.host, port=args.port,
                          request_timeout_s=args.request_timeout, cluster_token=token, **proxy_limits(args),
                          routing_weights=routing_weights(args),
                          cache_event_drop_fraction=args.cache_event_drop_fraction)
    except ValueError as e:  # ProxyConfig's own checks (max_model_len, timeouts, ...)
        raise ConfigError(str(e)) from None
    run(cfg)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.trust_remote_code:
        raise ConfigError("--trust-remote-code is refused: hybridpd never runs code from a model repository; "
                          "NemotronH and Qwen3.5 are implemented here, so drop the flag")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    from hybridpd.engine.model_source import looks_like_model_id

    if args.served_model_name is None and args.model and looks_like_model_id(args.model):
        args.served_model_name = args.model  # clients name a Hugging Face model by its id, as with vLLM
    check_port_free(args.host, args.port)  # before the model, Ray or any worker
    check_chat_template(args.chat_template)
    check_generation_config(args.generation_config)
    check_max_decode_share(args.max_decode_share)
    from hybridpd.deploy.ray_launcher import serve

    for role in ("prefill", "decode"):
        raw = getattr(args, f"{role}_resources", None)
        try:
            if raw is not None and not isinstance(json.loads(raw), dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise ConfigError(f"--{role}-resources must be a JSON object of resource amounts: {e}") from None
    config = engine_config_from_args(args)
    config.validate()  # bad engine flags: refused here, before Ray and the workers start
    model = config.model.path
    if not os.path.isfile(os.path.join(model, "config.json")):
        from hybridpd.engine.errors import ModelLoadError

        raise ModelLoadError(f"{model}: not a checkpoint directory (no config.json)")
    args.api_key, args.cluster_token = resolve_secrets(args)  # serve hands them on (deploy/secret_files.py)
    args.proxy_limits = proxy_limits(args, serve_max_seqs(args))  # checked before Ray starts
    args.tokenizer = config.model.tokenizer  # resolved (a model id's cache snapshot): the proxy's tokenizer too
    return serve(args, engine_argv(config), model, _model_max_len(model, args.max_model_len))


def cmd_bench(args: argparse.Namespace) -> int:
    from hybridpd.deploy.bench_serve import main as bench_main

    return bench_main(args.bench_args)


def _generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults of requests that set none, as vLLM's: auto (the model's "
                        "generation_config.json: temperature, top_p, top_k, min_p, penalties, max_new_tokens), vllm "
                        "(neutral: temperature 1, no top-p / top-k), or a directory holding a generation_config.json")


def _routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", default="round_robin",
                   choices=["round_robin", "least_loaded", "cache_aware", "adaptive"],
                   help="how the proxy picks workers; cache_aware: by each worker's cached prefix (attention blocks "
                        "and recurrent checkpoints, from its cache events) and load, skipping the prefill worker "
                        "when the decode worker's own prefill is cheaper; adaptive: the same")
    p.add_argument("--skip-prefill", default="auto", choices=["auto", "never", "always"],
                   help="cache_aware: when a decode worker prefills a prompt itself (auto: by the cost model)")
    p.add_argument("--prefill-decode", default="auto", choices=["auto", "never", "always"],
                   help="cache_aware: when a prefill worker runs a whole request itself (its mixed role; auto: while "
                        "the decode workers are saturated and it has room)")
    p.add_argument("--routing-weights", default="", metavar="K=V,...",
                   help="cache_aware costs, e.g. 'pull_token_cost=0.25,decode_running_cost=16,skip_max_tokens=64' "
                        "(fields of proxy.config.RoutingWeights)")


def routing_weights(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """RoutingWeights from --skip-prefill and --routing-weights (a ConfigError names a bad field)."""
    import dataclasses

    from hybridpd.proxy.config import RoutingWeights

    fields = {f.name: f for f in dataclasses.fields(RoutingWeights)}
    values: dict[str, object] = {"skip_prefill": args.skip_prefill,
                                 "prefill_decode": getattr(args, "prefill_decode", "auto")}
    for item in filter(None, (s.strip() for s in args.routing_weights.split(","))):
        key, _, raw = item.partition("=")
        if key not in fields or key in ("skip_prefill", "prefill_decode"):
            raise ConfigError(f"--routing-weights: unknown field {key!r} (known: {', '.join(sorted(fields))})")
        try:
            values[key] = int(raw) if key == "skip_max_tokens" else float(raw)
        except ValueError:
            raise ConfigError(f"--routing-weights: {key}={raw!r} is not a number") from None
    return RoutingWeights(**values)  # type: ignore[arg-type]


def _max_decode_share_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-decode-share", type=float, default=0.25, metavar="SHARE",
                   help="prefill workers: the mixed role's cap, whole requests (prompt and decode, sent by the proxy "
                        "while the decode workers are saturated) running on a prefill worker at once, as a share of "
                        "its --max-num-seqs; 0: prefill only (default: 0.25)")


def check_max_decode_share(value: float) -> None:
    """--max-decode-share is a share: in [0, 1] (a ConfigError otherwise, before anything starts)."""
    if not 0 <= value <= 1:
        raise ConfigError(f"--max-decode-share must be in [0, 1], got {value}")


def _secret_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file holding the API key clients must send as 'Authorization: Bearer KEY' (default: env "
                        "HYBRIDPD_API_KEY_FILE, then HYBRIDPD_API_KEY, then --api-key)")
    p.add_argument("--api-key", default=None,
                   help="the API key itself (visible in ps: prefer --api-key-file or HYBRIDPD_API_KEY)")


def add_serving_commands(sub: argparse._SubParsersAction, engine_args: Callable[[argparse.ArgumentParser], None]
                         ) -> None:
    p = sub.add_parser("serve", help="start Ray, prefill + decode workers and the OpenAI proxy")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory or Hugging Face model id, as vLLM's `serve MODEL` (same as --model)")
    engine_args(p)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template (a file, or the template text) the proxy uses instead of the model's")
    _generation_config_arg(p)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="refused: hybridpd runs no code from a model repository (both families are built in)")
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPUs Ray reserves per worker (default: 1 when --device is auto or cuda and the Ray cluster "
                        "has a GPU per worker, else 0; Ray hides the GPUs from a worker that reserves none)")
    p.add_argument("--address", default=None,
                   help="attach to a running Ray cluster ('auto' or HOST:PORT of its head; default: start a local "
                        "one); workers then bind on the address of the node they land on")
    p.add_argument("--prefill-resources", default=None, metavar="JSON",
                   help="Ray custom resources each prefill worker needs, to place it on chosen nodes (e.g. "
                        "'{\"prefill_node\": 1}' with `ray start --resources '{\"prefill_node\": 4}'` there)")
    p.add_argument("--decode-resources", default=None, metavar="JSON", help="the same for decode workers")
    p.add_argument("--host", default="127.0.0.1", help="interface the proxy listens on")
    p.add_argument("--port", type=int, default=8000, help="proxy port (checked before anything starts)")
    p.add_argument("--colocated", action="store_true", help="serve without disaggregation (for comparison)")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks of each prefill worker (default: --tensor-parallel-size)")
    p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks of each decode worker (default: --tensor-parallel-size); P and D may "
                        "differ, the handoff moves each D rank's head slices from the P ranks that hold them")
    _max_decode_share_arg(p)
    _routing_args(p)
    p.add_argument("--served-model-name", default=None,
                   help="model id clients use in requests and /v1/models (none: the checkpoint directory's name)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take end to end; every worker call gets the time left")
    _secret_args(p)
    add_proxy_limit_args(p)
    p.add_argument("--prometheus-targets", default=None, metavar="PATH",
                   help="Prometheus file_sd file listing the proxy and the workers' metrics ports, written once they "
                        "are up and removed at exit (default: deploy/prometheus/targets/serve-<port>.json, which "
                        "deploy/prometheus/prometheus.yml reads; 'none': do not write one)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="run one prefill or decode worker as a plain process")
    engine_args(p)
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"], help="what this worker does")
    p.add_argument("--host", default="127.0.0.1", help="interface the gRPC server listens on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: any free port, -1: off)")
    p.add_argument("--advertise-host", default=None, help="host other workers use to reach this one")
    p.add_argument("--lease-seconds", type=float, default=30.0,
                   help="prefill: how long finished prompts stay pinned for a decode worker's pull")
    p.add_argument("--transfer-policy", default="recompute", choices=["recompute", "fail"],
                   help="decode: what to do when a KV pull fails")
    p.add_argument("--pull-timeout", type=float, default=10.0, help="decode: seconds before a pull is given up")
    p.add_argument("--model-name", default=None, help="model name reported by Health (default: the directory name)")
    p.add_argument("--cluster-token-file", default=None,
                   help="file holding the cluster's shared token, required on every worker RPC (default: env "
                        "HYBRIDPD_CLUSTER_TOKEN_FILE, else HYBRIDPD_CLUSTER_TOKEN; none: RPCs are open)")
    p.add_argument("--prefill-peer", action="append", default=None, metavar="ADDR",
                   help="decode: pull only from this prefill worker address (repeatable; default: any prefill "
                        "worker that proves it holds the cluster token)")
    p.add_argument("--max-pinned-fraction", type=float, default=0.5,
                   help="prefill: share of each cache pool that leased, not yet pulled pages may pin; beyond it "
                        "Prefill answers RESOURCE_EXHAUSTED (default: 0.5)")
    _max_decode_share_arg(p)
    p.add_argument("--nixl-progress-thread", action="store_true",
                   help="run NIXL's progress thread (it busy-polls a core even when idle; default: off, the worker's "
                        "step loop progresses transfers while leases or pulls are in flight). Not on a decode worker "
                        "with GPU caches: one aborted inside UCX on an H200 (kvtransfer/README.md)")
    p.add_argument("--register-with", action="append", default=None, metavar="URL",
                   help="proxy to register with (http://host:port; repeatable; a host resolving to several "
                        "addresses registers with each): the proxy routes to this worker from then on, renewed "
                        "every --heartbeat seconds, dropped 5 heartbeats after the last")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between registrations (default: 1)")
    p.add_argument("--engine-stall-timeout", type=float, default=300.0,
                   help="Health answers not ready while the engine has been in one step (or hook) for longer than "
                        "this many seconds (wedged, though gRPC still answers): proxies route around the worker and "
                        "move the requests waiting on it (default: 300, above the minutes a first step may spend "
                        "compiling GPU kernels; 0: never)")
    p.add_argument("--tls-cert-file", default=None,
                   help="PEM certificate: serve gRPC over TLS and present it on calls to peers (default: env "
                        "HYBRIDPD_TLS_CERT_FILE; none: plaintext)")
    p.add_argument("--tls-key-file", default=None, help="PEM key of --tls-cert-file (env HYBRIDPD_TLS_KEY_FILE)")
    p.add_argument("--tls-ca-file", default=None,
                   help="PEM CA that signs every peer: verify servers and require client certificates (mutual TLS; "
                        "env HYBRIDPD_TLS_CA_FILE)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("proxy", help="run the OpenAI-compatible proxy as a plain process")
    p.add_argument("--prefill", nargs="+", default=[], metavar="ADDR", help="prefill workers' gRPC host:port")
    p.add_argument("--decode", nargs="*", default=[], metavar="ADDR",
                   help="decode workers' gRPC host:port (static members; others may register at run time)")
    p.add_argument("--model", default=None, help="checkpoint dir (tokenizer, max length)")
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name", default=None,
                   help="model name clients send (default: the --model directory name, else 'hybridpd')")
    p.add_argument("--max-model-len", type=human_readable_int_or_auto, default=None,
                   help="longest prompt + output the proxy admits (32k, 32K; auto: --model's config, else 4096)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template (a file, or the template text) used instead of the model's")
    _generation_config_arg(p)
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer and chat template directory (or Hugging Face id), when not --model's")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8000, help="port (checked before anything starts)")
    _routing_args(p)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from arrival to the last token; every worker call gets what is left")
    p.add_argument("--colocated", action="store_true", help="decode workers compute whole prompts (no prefill)")
    p.add_argument("--cache-event-drop-fraction", type=float, default=0.0, help=argparse.SUPPRESS)  # test knob
    _secret_args(p)
    add_proxy_limit_args(p)
    p.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help="file holding the token sent to workers as gRPC metadata x-hybridpd-token (default: env "
                        "HYBRIDPD_CLUSTER_TOKEN_FILE, then HYBRIDPD_CLUSTER_TOKEN)")
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser("bench", help="benchmarks: `hybridpd bench serve --help`")
    p.add_argument("bench_kind", choices=["serve"], help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    p.set_defaults(func=cmd_bench)
