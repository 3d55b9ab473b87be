"""The ``gyre`` command.

    gyre up [--engines N] [--redis-url URL]   start Redis (own, AOF) + every service; print addresses
    gyre status                               what runs where, and whether it is SERVING
    gyre down                                 stop everything gracefully (SIGTERM, then SIGKILL)
    gyre run [--mode elastic|colocate|async] [--config FILE] [...]   the main job (see `gyre run --help`)
    gyre trajectory stats --records FILE.jsonl [--max-paths K]
    gyre bench scheduler --trace FILE.jsonl --cells N [...] [--json]

Subcommands import their heavy parts lazily so ``gyre --help`` and ``gyre status`` stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _launcher(args: argparse.Namespace):  # noqa: ANN202 - lazy import keeps --help fast
    from services.launcher import Launcher

    return Launcher(Path(args.data_dir), Path(args.config))


def cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import default_specs

    launcher = _launcher(args)
    launcher.up(default_specs(args.engines), redis_url=args.redis_url or os.environ.get("REDIS_URL"))
    print("Gyre is up. `gyre status` shows health; `gyre down` stops everything.")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = _launcher(args).status()
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    if not status["up"]:
        print("Gyre is not up (`gyre up` starts it)")
        return 1
    print(f"redis       {status['redis']['url']}")
    for name, s in status["services"].items():
        state = "SERVING" if s["serving"] else ("running, not serving" if s["alive"] else "DEAD")
        print(f"{name:<11} {s['address']:<22} pid {s['pid']:<8} {state}")
    return 0 if all(s["serving"] for s in status["services"].values()) else 1


def cmd_down(args: argparse.Namespace) -> int:
    _launcher(args).down()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands that own their whole argument list.
    if argv[:2] == ["trajectory", "stats"]:
        from services.trajectory.cli import stats_main

        return stats_main(argv[2:])
    if argv[:2] == ["bench", "scheduler"]:
        from services.scheduler.sim_cli import bench_main

        return bench_main(argv[2:])
    if argv[:1] == ["run"]:
        from services.run import run_main

        return run_main(argv[1:])

    from services.launcher import DEFAULT_CONFIG, REPO

    parser = argparse.ArgumentParser(prog="gyre", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data-dir", default=str(REPO / ".gyre"), help="redis data, spool, logs, run state")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config shared by the services")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start redis + all services")
    up.add_argument("--engines", type=int, default=2, help="rollout engine cells to start")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.set_defaults(fn=cmd_up)
    st = sub.add_parser("status", help="show services and health")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
    sub.add_parser("down", help="stop everything").set_defaults(fn=cmd_down)
    sub.add_parser("run", help="run the main job (see `gyre run --help`)")
    sub.add_parser("trajectory", help="`gyre trajectory stats --records FILE.jsonl [--max-paths K]`")
    sub.add_parser("bench", help="`gyre bench scheduler --trace FILE.jsonl --cells N [--json]`")
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, TimeoutError) as exc:
        print(f"gyre: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
