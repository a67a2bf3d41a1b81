"""OpenAI-compatible HTTP proxy in front of prefill and decode workers (never imports torch or `engine`).

    from proxy.config import ProxyConfig
    from proxy.app import create_app      # FastAPI app, e.g. for tests
    from proxy.server import run          # blocking: serves the app with uvicorn

Request path: `app` (endpoints) -> `openai_schema` (validation) -> `tokenize` -> `generation` (routing, P.Prefill,
D.Generate over `workers`) -> `responses` (OpenAI JSON / SSE), with `metrics` recording latencies.
"""
