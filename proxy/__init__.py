"""OpenAI-compatible HTTP proxy in front of prefill and decode workers (never imports torch; from `engine` only
the tensor-free chat-template renderer, `engine.chat_template`, that the engine's Tokenizer uses too).

    from hybridpd.proxy.config import ProxyConfig
    from hybridpd.proxy.app import create_app      # FastAPI app, e.g. for tests
    from hybridpd.proxy.server import run          # blocking: serves the app with uvicorn

Request path: `app` (endpoints) -> `openai_schema` (validation) -> `tokenization` (in a worker thread) ->
`choices` (one `generation` per prompt x sample: routing, P.Prefill, D.Generate over `workers`, with deadlines and
the cluster token from `credentials`) -> `responses` (OpenAI JSON / SSE), with `metrics` recording latencies.
`cluster_view` answers `/health` from a background cache and `/v1/cluster` live.
"""
