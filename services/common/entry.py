"""The one way a Gyre service process starts: ``run_service``.

Every ``services/<svc>/main.py`` is a few lines that call this with its config class and a
``build`` function. It gives all services the same command line (``--config FILE`` plus
``--<field> value`` for any config field, ``--port-file F`` for launchers), the same logging and
metrics setup, and the same failure mode: a bad config or an unreachable dependency prints one
sentence and exits 2 instead of a traceback.

    def main(argv=None) -> int:
        return run_service("trajectory", TrajectoryConfig, build_trajectory, argv)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from services.common import security
from services.common.config import ServerConfig, fields_doc, load_config
from services.common.logging import get_logger, setup_logging
from services.common.metrics import start_metrics_server
from services.common.server import GyreServer, serve

C = TypeVar("C", bound=ServerConfig)
Built = tuple[GyreServer, Callable[[], None] | None]


def env_prefix(name: str) -> str:
    """``GYRE_<NAME>_``: the environment prefix of service ``name``'s settings."""
    return f"GYRE_{name.upper().replace('-', '_')}_"


def run_service(name: str, config_cls: type[C], build: Callable[[C], Built],
                argv: Sequence[str] | None = None) -> int:
    """Parse config, set up logging/metrics, build, mark SERVING, block until SIGTERM."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(usage(name, config_cls))
        return 0
    path, rest = _take(args, "--config")
    port_path, rest = _take(rest, "--port-file")
    try:
        cfg = load_config(config_cls, path=path, section=name, env_prefix=env_prefix(name), argv=rest)
    except ValueError as exc:
        print(f"gyre-{name}: {exc}", file=sys.stderr)
        return 2
    setup_logging(json=cfg.log_json, level=cfg.log_level, service=name)
    log = get_logger(f"services.{name}")
    try:
        security.configure(security.security_from(cfg))
        server, on_shutdown = build(cfg)
    except (ValueError, OSError) as exc:
        print(f"gyre-{name}: {exc}", file=sys.stderr)
        return 2
    server.start()
    server.set_serving(True)
    metrics_port = start_metrics_server(cfg.metrics_port, cfg.host) if cfg.metrics_port >= 0 else None
    log.info("serving", address=f"{cfg.host}:{server.port}", metrics_port=metrics_port, pid=os.getpid())
    if port_path:
        tmp = Path(port_path + ".tmp")
        tmp.write_text(json.dumps({"port": server.port, "metrics_port": metrics_port, "pid": os.getpid(),
                                   **server.info}))
        tmp.replace(port_path)
    serve(server, grace_s=cfg.grace_s, on_shutdown=on_shutdown)
    # In-flight RPCs had grace_s and were then cancelled; a handler thread still blocked in a
    # long-poll (a lease wait, a weights or attach wait) must not keep the process alive: the
    # RPC thread pool's threads are joined at interpreter exit, so leave without waiting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove ``flag VALUE`` / ``flag=VALUE`` from args: (value, remaining args)."""
    out: list[str] = []
    value: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == flag:
            if i + 1 >= len(args):
                raise SystemExit(f"{flag} needs a value")
            value = args[i + 1]
            i += 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return value, out


def usage(name: str, config_cls: type[Any]) -> str:
    lines = [f"usage: gyre-{name} [--config FILE.toml] [--port-file F] [--<field> VALUE ...]", "",
             f"Fields (TOML section [{name}], env {env_prefix(name)}<FIELD>, or flags):"]
    for fname, tname, default, doc in fields_doc(config_cls):
        lines.append(f"  --{fname.replace('_', '-'):<24} {tname:<10} default {default!r}: {doc}")
    return "\n".join(lines)
