"""Run the proxy: `run(config)` serves `create_app(config)` with uvicorn until interrupted (blocking).

uvicorn runs the guarded h11 protocol (`proxy.http_guard`): header and body deadlines, a connection cap and the
keep-alive timeout of `config.http`; what it drops is counted in `hybridpd_admission_rejected_total{reason}`.
"""

from __future__ import annotations

import uvicorn
from hybridpd.proxy.app import create_app
from hybridpd.proxy.config import ProxyConfig
from hybridpd.proxy.http_guard import uvicorn_config


def run(config: ProxyConfig, log_level: str = "info") -> None:
    """Serve on `config.host:config.port`. Blocks; returns after SIGINT/SIGTERM."""
    app = create_app(config)
    app.state.proxy.bodies.start()  # the big-body parser process, spawned before the first request needs it
    admission = app.state.proxy.admission
    cfg = uvicorn_config(app, config.http, admission.count_rejection, host=config.host, port=config.port,
                         log_level=log_level, access_log=False)
    uvicorn.Server(cfg).run()
