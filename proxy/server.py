"""Run the proxy: `run(config)` serves `create_app(config)` with uvicorn until interrupted (blocking)."""

from __future__ import annotations

import uvicorn

from proxy.app import create_app
from proxy.config import ProxyConfig


def run(config: ProxyConfig, log_level: str = "info") -> None:
    """Serve on `config.host:config.port`. Blocks; returns after SIGINT/SIGTERM."""
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, timeout_keep_alive=30,
                access_log=False)
