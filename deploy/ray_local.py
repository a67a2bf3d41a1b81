"""The Ray that `hybridpd serve` starts for itself (no `--address`): on loopback, private, with its own auth token.

    prepare_local_ray(secret_files) -> LocalRay  before `ray.init`: sweep dead serves' dirs, make a private 0700
                                                 dir for Ray's temp dir, bind Ray to loopback, give Ray an auth
                                                 token held in memory
    LocalRay.init_kwargs                         what to pass to `ray.init`
    LocalRay.close()                             after `ray.shutdown()`: remove the private dir (session logs,
                                                 sockets)

Loopback. Ray's C++ servers (GCS, raylet, every core worker) listen on 127.0.0.1 only when the node's IP is
127.0.0.1, and the Python agents (runtime-env agent, autoscaler monitor, dashboard agent) bind that IP too. But
`ray.init(_node_ip_address="127.0.0.1")` is rewritten to the host's external IP unless Ray considers itself
unable to form a multi-node cluster, which `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` says (read at import by every
Ray process, so it goes in the environment that Ray's daemons and workers inherit). The dashboard is off. A serve
that joins a cluster (`--address`) binds where that cluster's nodes were started (docs/DEPLOY.md lists the ports).

Auth. Ray (2.60 here) turns on its token auth for a new local cluster and, without a token, writes one to
~/.ray/auth_token (0644). Here Ray reads a fresh random token from `RAY_AUTH_TOKEN_PATH`, an in-memory file of
this process (deploy/secret_files.py): nothing on disk, gone with serve. A user's explicit RAY_AUTH_* settings win.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any

from hybridpd.deploy.secret_files import SecretFiles, private_ray_dir, sweep_stale_ray_dirs

log = logging.getLogger("hybridpd.serve")

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray then takes 127.0.0.1 as the node IP and every Ray server binds it."""


@dataclass
class LocalRay:
    temp_dir: str
    """The private 0700 dir holding Ray's temp dir (which Ray makes 0777)."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _bind_loopback() -> None:
    os.environ.update(LOOPBACK_ENV)
    import ray._private.ray_constants as ray_constants  # already imported: the constant was read at its import

    ray_constants.ENABLE_RAY_CLUSTER = False


def _own_auth_token(secret_files: SecretFiles) -> None:
    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = secret_files.add("ray-auth-token", secrets.token_hex(32))


def prepare_local_ray(secret_files: SecretFiles) -> LocalRay:
    removed = sweep_stale_ray_dirs()
    if removed:
        log.info("removed %d Ray temp dir(s) of serves that died: %s", len(removed), ", ".join(removed))
    _own_auth_token(secret_files)  # before Ray's first import: its config reads RAY_AUTH_MODE once
    _bind_loopback()
    private = private_ray_dir()
    ray_dir = os.path.join(private, "r")
    return LocalRay(private, {"_node_ip_address": "127.0.0.1", "_temp_dir": ray_dir, "include_dashboard": False})
