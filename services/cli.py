"""The ``gyre`` command.

    gyre up [--model NAME] [--engines N] [--harness-concurrency N] [--redis-url URL]
                                              Redis (own, AOF) + every service + the built-in harness
    gyre status [--json]                      what runs where, and whether it is SERVING
    gyre submit FILE.toml [--field value ...] submit the file's [job]; prints the job id on its last line
    gyre watch JOB [--json]                   live progress until the job ends (--json: one event per line)
    gyre jobs                                 every job, its state and progress
    gyre cancel JOB [--reason TEXT]
    gyre cells [--json]                       every cell: role, liveness, load, cordon
    gyre credentials DIR [--host H ...]       a deployment's per-role tokens, KV key, CA + node TLS certificate
    gyre cordon CELL [--reason TEXT]          take a cell out of rollout (its requests migrate; it trains)
    gyre uncordon CELL                        give it back to the policy
    gyre report JOB [--out DIR]               report.html, figures, metrics.jsonl of a job
    gyre down                                 stop everything gracefully (SIGTERM, then SIGKILL)
    gyre run [--job FILE] [--config FILE] [...]   up + submit + watch + report + down (`gyre run --help`)
    gyre run --compare [--seeds N] [...]      the three modes on the same job (N seeds: spread of held-out, wall)
    gyre run --compare --modes A,B [...]      only those modes (e.g. colocate,elastic)
    gyre run --compare --vary FIELD=A,B [...] one job field's values instead of the modes (an ablation)
    gyre trajectory stats --records FILE.jsonl [--max-paths K]
    gyre replay --records FILE.jsonl [--max-paths N] [--steps N]
    gyre replay --trace FILE.jsonl [--time-scale X] [gyre run flags] [--JOB-FIELD value ...]
                                              train on recorded executions (trajectory + trainer, no engine)
    gyre bench scheduler --trace FILE.jsonl --cells N [...] [--json]

Clients of a stack find its addresses in <data-dir>/run/state.json (`gyre up` writes it), or take
--scheduler HOST:PORT. A stack with tokens takes the caller's credential from the environment
(GYRE_TOKEN_FILE, e.g. an operator's; GYRE_TLS_CA_FILE for TLS). Subcommands import their heavy parts lazily so ``gyre --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _launcher(args: argparse.Namespace):  # noqa: ANN202 - lazy import keeps --help fast
    from services.launcher import Launcher

    return Launcher(Path(args.data_dir), Path(args.config))


def cmd_up(args: argparse.Namespace) -> int:
    from services.run import RunConfig, bring_up

    if args.redis_url:
        os.environ["REDIS_URL"] = args.redis_url
    run = RunConfig(engines=args.engines, harness_concurrency=args.harness_concurrency)
    launcher = _launcher(args)
    up, model_dir, _env = bring_up(launcher, run, args.model, echo=print)
    pid = launcher.start_supervisor()
    print(f"supervisor  restarts whatever dies (pid {pid}, log {launcher.data_dir / 'logs' / 'supervisor.log'})")
    print(f"Gyre is up, serving {model_dir}. `gyre submit deploy/config/job.toml` starts a job; "
          f"`gyre status` shows health; `gyre down` stops everything.")
    return 0


def _addresses(args: argparse.Namespace) -> dict[str, str]:
    """Service addresses of the stack this command talks to (--scheduler wins for the scheduler)."""
    status = _launcher(args).status()
    out = {name: s["address"] for name, s in status.get("services", {}).items() if s.get("address")}
    if getattr(args, "scheduler", None):
        out["scheduler"] = args.scheduler
    if "scheduler" not in out:
        raise ValueError(f"no Gyre stack is up under {args.data_dir} (`gyre up` starts one); "
                         f"or give --scheduler HOST:PORT")
    return out


def _scheduler(args: argparse.Namespace):  # noqa: ANN202 - lazy import keeps --help fast
    from services.scheduler.client import SchedulerClient

    return SchedulerClient(_addresses(args)["scheduler"])


def cmd_submit(args: argparse.Namespace, extra: list[str]) -> int:
    from services.scheduler.jobfile import load_job

    spec = load_job(args.file, extra, job_id=args.job_id)
    with _scheduler(args) as scheduler:
        job = scheduler.submit_job(spec)
    print(f"submitted: {job.spec.mode.value} job of {job.spec.num_steps} steps x {job.spec.step_size} executions")
    print(job.job_id)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from services.jobwatch import JobView, follow
    from services.scheduler.jobs import spec_dict
    from services.tracking import Trackers, parse_loggers

    if args.logger and args.json:
        raise ValueError("--logger logs the job's figures while watching it live; --json only prints its events")
    parse_loggers(args.logger)  # an unknown tracker: one sentence before anything else

    with _scheduler(args) as scheduler:
        view = JobView(args.job)
        job = scheduler.get_job(args.job)  # NOT_FOUND in one sentence before anything else
        if args.json:
            for ev in follow(scheduler, view):
                print(json.dumps(view.to_json_event(ev)), flush=True)
            job = scheduler.get_job(args.job)
            print(json.dumps({"kind": "end", "job_id": args.job, "state": job.state.value,
                              "weight_version": job.weight_version, "message": job.message,
                              "outcomes": view.outcomes, "evaluations": view.evals}), flush=True)
        else:
            from services.progress import Progress

            import tempfile

            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.job)
            log_path = Path(tempfile.gettempdir()) / f"gyre-watch-{safe}.log"
            trackers = Trackers.open(args.logger, args.logger_dir or f"reports/{safe}", job_id=args.job,
                                     config=spec_dict(job.spec))
            try:
                with Progress(scheduler, view, quiet=args.quiet, log_path=log_path) as progress:
                    for ev in follow(scheduler, view):
                        trackers.add(ev)
                        progress.update()
                    progress.update(force=True)
            finally:
                trackers.close()
            job = scheduler.get_job(args.job)
            print(f"{args.job}: {job.state.value} at weight version {job.weight_version}"
                  + (f" ({job.message})" if job.message else ""))
    return 0 if job.state.value == "completed" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs: list = []
    with _scheduler(args) as scheduler:
        token = ""
        while True:  # every page
            page, token = scheduler.list_jobs(page_size=1000, page_token=token)
            jobs += page
            if not token:
                break
    if args.json:
        print(json.dumps([{"job_id": j.job_id, "state": j.state.value, "mode": j.spec.mode.value,
                           "step": j.current_step, "num_steps": j.spec.num_steps,
                           "weight_version": j.weight_version, "message": j.message} for j in jobs], indent=1))
        return 0
    if not jobs:
        print("no jobs (`gyre submit FILE.toml` submits one)")
    for j in jobs:
        print(f"{j.job_id:<32} {j.state.value:<10} {j.spec.mode.value:<9} step {j.current_step}/{j.spec.num_steps} "
              f"v{j.weight_version}  {j.message}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _scheduler(args) as scheduler:
        job, dropped = scheduler.cancel_job(args.job, args.reason)
    print(f"{args.job}: {job.state.value} ({dropped} queued executions dropped)")
    return 0


SERVICE_SECTIONS = ("SCHEDULER", "GATEWAY", "ENGINE", "TRAINER", "TRAJECTORY", "REWARD", "CELL_DAEMON")


def cmd_credentials(args: argparse.Namespace) -> int:
    """Make a deployment's secrets in DIR (never printed): per-role tokens, one file per role for
    its holders, the KV migration key and (unless --no-tls) a CA and the node certificate every
    service serves TLS with; then say which settings point to them."""
    import secrets
    from pathlib import Path

    from services.common import pki

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o750)
    names = ["tokens", "harness.token", "operator.token", "internal.token", "kv.key"]
    if not args.no_tls:
        names += ["ca.pem", "ca.key", "node.pem", "node.key"]
    existing = [f for f in names if (out / f).exists()]
    if args.keep and len(existing) == len(names):
        print(f"{out} already holds this deployment's credentials; kept")
        return 0
    if existing and not args.force:
        print(f"gyre: {out} already holds {', '.join(existing)}; --force makes new ones (every holder must get them)",
              file=sys.stderr)
        return 2
    try:
        files: dict[str, bytes] = {} if args.no_tls else pki.make_tls(args.host)
    except ValueError as exc:
        print(f"gyre: {exc}", file=sys.stderr)
        return 2
    roles = {r: secrets.token_urlsafe(32) for r in ("internal", "harness", "operator")}
    files["tokens"] = ("# ROLE TOKEN: what every Gyre service accepts (auth_tokens_file)\n" +
                       "".join(f"{r} {t}\n" for r, t in roles.items())).encode()
    for r, t in roles.items():
        files[f"{r}.token"] = (t + "\n").encode()
    files["kv.key"] = (secrets.token_hex(32) + "\n").encode()
    for name in names:
        path = out / name
        path.unlink(missing_ok=True)
        # the CA key signs certificates: its owner only (move it offline once the hosts have theirs)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if name == "ca.key" else 0o640)
        with os.fdopen(fd, "wb") as fh:
            fh.write(files[name])
    print(f"wrote {', '.join(names)} to {out} (mode 0640, ca.key 0600; chgrp them to the services' group). "
          "In gyre.env:")
    for svc in SERVICE_SECTIONS:
        print(f"  GYRE_{svc}_AUTH_TOKENS_FILE={out / 'tokens'}")
    print(f"  GYRE_ENGINE_KV_AUTH_KEY_FILE={out / 'kv.key'}")
    if not args.no_tls:
        for svc in SERVICE_SECTIONS:
            print(f"  GYRE_{svc}_TLS_CERT_FILE={out / 'node.pem'}  GYRE_{svc}_TLS_KEY_FILE={out / 'node.key'}  "
                  f"GYRE_{svc}_TLS_CA_FILE={out / 'ca.pem'}")
        print(f"the node certificate names: {', '.join(pki.subject_alt_names(args.host))}")
    harness_ca = "" if args.no_tls else f", GYRE_HARNESS_TLS_CA_FILE={out / 'ca.pem'}"
    operator_ca = "" if args.no_tls else f" and GYRE_TLS_CA_FILE={out / 'ca.pem'}"
    print(f"harnesses: GYRE_HARNESS_AUTH_TOKEN_FILE={out / 'harness.token'} (and as the OpenAI api key)"
          f"{harness_ca}; operators: GYRE_TOKEN_FILE={out / 'operator.token'}{operator_ca} for `gyre`")
    return 0


def cmd_cells(args: argparse.Namespace) -> int:
    with _scheduler(args) as scheduler:
        cells = scheduler.list_cells()
    rows = [{"cell_id": i.cell.cell_id, "role": i.cell.role.value, "core": i.cell.is_core, "alive": i.alive,
             "heartbeat_age_s": round(i.heartbeat_age_s, 1), "inflight": i.cell.inflight,
             "weight_version": i.cell.weight_version, "cordoned": i.cell.cordoned,
             "cordon_reason": i.cell.cordon_reason} for i in cells]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'cell':<12} {'role':<10} {'alive':<6} {'inflight':>8} {'version':>8}  cordon")
    for r in rows:
        role = f"{r['role']}{'*' if r['core'] else ''}"
        print(f"{r['cell_id']:<12} {role:<10} {'yes' if r['alive'] else 'NO':<6} {r['inflight']:>8} "
              f"{r['weight_version']:>8}  {r['cordon_reason']}")
    return 0


def cmd_cordon(args: argparse.Namespace) -> int:
    with _scheduler(args) as scheduler:
        cell = scheduler.cordon_cell(args.cell, cordoned=args.cmd == "cordon", reason=args.reason)
    if cell.cordoned:
        print(f"{cell.cell_id}: cordoned ({cell.cordon_reason}); it is {cell.role.value} now and takes no rollout "
              f"work: a running job's policy drains it to training")
    else:
        print(f"{cell.cell_id}: uncordoned; it is {cell.role.value} and the policy may move it again")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from services.jobwatch import JobView, write_job_report
    from services.trainer.client import TrainerClient
    from services.trajectory.client import TrajectoryClient

    addresses = _addresses(args)
    with _scheduler(args) as scheduler:
        scheduler.get_job(args.job)
        view = JobView(args.job)
        for ev in scheduler.watch(args.job, follow=False):
            view.add(ev)
        trainer = TrainerClient(addresses["trainer"]) if "trainer" in addresses else None
        trajectory = TrajectoryClient(addresses["trajectory"]) if "trajectory" in addresses else None
        try:
            path = write_job_report(view, args.out or f"reports/{args.job}", scheduler=scheduler, trainer=trainer,
                                    trajectory=trajectory)
        finally:
            for c in (trainer, trajectory):
                if c is not None:
                    c.close()
    print(f"report: {path}")
    return 0


def _trainer_group(address: str) -> list[dict[str, Any]]:
    """The ranks of the trainer's sharded group (empty: one process, no job, or no answer)."""
    from services.common.errors import GyreError
    from services.trainer.client import TrainerClient

    try:
        with TrainerClient(address) as trainer:
            st = trainer.status()
    except GyreError:
        return []
    return [{"rank": g.rank, "pid": g.pid, "peak_rss_mib": round(g.peak_rss_mib, 1), "alive": g.alive}
            for g in st.group]


def cmd_status(args: argparse.Namespace) -> int:
    status = _launcher(args).status()
    trainer = status.get("services", {}).get("trainer")
    if trainer and trainer.get("serving"):
        status["trainer_group"] = _trainer_group(trainer["address"])
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    if not status["up"]:
        print("Gyre is not up (`gyre up` starts it)")
        return 1
    print(f"redis       {status['redis']['url']}")
    for name, s in status["services"].items():
        state = "SERVING" if s["serving"] else ("running, not serving" if s["alive"] else "DEAD")
        restarts = f"  restarted {s['restarts']}x (last: {s['last_exit']})" if s.get("restarts") else ""
        print(f"{name:<11} {s['address']:<22} pid {s['pid']:<8} {state}{restarts}")
        if name == "trainer":
            for g in status.get("trainer_group", []):
                print(f"  rank {g['rank']:<5} pid {g['pid']:<8} peak RSS {g['peak_rss_mib']:.0f} MiB at the last step"
                      f"{'' if g['alive'] else '  ENDED'}")
    sup = status.get("supervisor")
    print(f"supervisor  {'running' if sup and sup['alive'] else 'NOT RUNNING'}" + (f" (pid {sup['pid']})" if sup else ""))
    for name, f in status.get("failed", {}).items():
        print(f"FAILED      {name}: {f['reason']}")
    return 0 if all(s["serving"] for s in status["services"].values()) else 1


def cmd_down(args: argparse.Namespace) -> int:
    _launcher(args).down()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from services.common import security

    security.configure_client_from_env()
    # Subcommands that own their whole argument list.
    if argv[:2] == ["trajectory", "stats"]:
        from services.trajectory.cli import stats_main

        return stats_main(argv[2:])
    if argv[:2] == ["bench", "scheduler"]:
        from services.scheduler.sim.cli import bench_main

        return bench_main(argv[2:])
    if argv[:1] == ["replay"] and "--trace" in argv:
        from services.replay_trace import trace_main

        return trace_main(argv[1:])
    if argv[:1] == ["replay"]:
        from services.replay import replay_main

        return replay_main(argv[1:])
    if argv[:1] == ["run"] and "--compare" in argv:
        from services.compare import compare_main

        return compare_main([a for a in argv[1:] if a != "--compare"])
    if argv[:1] == ["run"]:
        from services.run import run_main

        return run_main(argv[1:])

    from services.launcher import DEFAULT_CONFIG, REPO

    parser = argparse.ArgumentParser(prog="gyre", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data-dir", default=str(REPO / ".gyre"), help="redis data, spool, logs, run state")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config shared by the services")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start redis + all services + the built-in harness")
    up.add_argument("--model", default="builtin-tiny", help="model the engines serve (name or checkpoint dir)")
    up.add_argument("--engines", type=int, default=2, help="rollout engine cells to start")
    up.add_argument("--harness-concurrency", type=int, default=16, help="executions the built-in harness runs at once")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.set_defaults(fn=cmd_up)
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--scheduler", default=None, help="scheduler HOST:PORT (default: the stack under --data-dir)")
    sm = sub.add_parser("submit", parents=[client], help="submit a job file's [job]; prints the job id last")
    sm.add_argument("file", help="TOML file with a [job] table (e.g. deploy/config/job.toml)")
    sm.add_argument("--job-id", default="", help="job id (default: a fresh one)")
    sm.set_defaults(fn=cmd_submit, takes_extra=True)
    wa = sub.add_parser("watch", parents=[client], help="follow a job until it ends")
    wa.add_argument("job")
    wa.add_argument("--json", action="store_true", help="one JSON event per line; the last has state, weight_version")
    wa.add_argument("--quiet", action="store_true", help="plain progress lines instead of a live table")
    wa.add_argument("--logger", default="", help="trackers that log every step's figures: tensorboard, wandb (offline "
                                                 "unless WANDB_MODE says otherwise), mlflow; comma-separated")
    wa.add_argument("--logger-dir", default="", help="where the trackers write (default: reports/<job>)")
    wa.set_defaults(fn=cmd_watch)
    jb = sub.add_parser("jobs", parents=[client], help="list jobs")
    jb.add_argument("--json", action="store_true")
    jb.set_defaults(fn=cmd_jobs)
    ca = sub.add_parser("cancel", parents=[client], help="cancel a job")
    ca.add_argument("job")
    ca.add_argument("--reason", default="cancelled from the command line")
    ca.set_defaults(fn=cmd_cancel)
    cr = sub.add_parser("credentials", help="make a deployment's per-role tokens, KV key and TLS certificates in DIR")
    cr.add_argument("dir")
    cr.add_argument("--force", action="store_true", help="replace existing ones")
    cr.add_argument("--keep", action="store_true", help="succeed without writing when DIR holds them all")
    cr.add_argument("--host", action="append", default=[],
                    help="a host name or IP clients dial (repeatable): named in the node certificate, "
                         "besides localhost, 127.0.0.1 and the compose service names")
    cr.add_argument("--no-tls", action="store_true", help="tokens and KV key only (TLS terminated elsewhere)")
    cr.set_defaults(fn=cmd_credentials)
    ce = sub.add_parser("cells", parents=[client], help="list cells (role, liveness, load, cordon)")
    ce.add_argument("--json", action="store_true")
    ce.set_defaults(fn=cmd_cells)
    co = sub.add_parser("cordon", parents=[client], help="take a cell out of rollout (it trains instead)")
    co.add_argument("cell")
    co.add_argument("--reason", default="cordoned from the command line")
    co.set_defaults(fn=cmd_cordon)
    un = sub.add_parser("uncordon", parents=[client], help="give a cordoned cell back to the policy")
    un.add_argument("cell")
    un.set_defaults(fn=cmd_cordon, reason="")
    rp = sub.add_parser("report", parents=[client], help="write a job's report")
    rp.add_argument("job")
    rp.add_argument("--out", default="", help="report directory (default: reports/JOB)")
    rp.set_defaults(fn=cmd_report)
    st = sub.add_parser("status", help="show services and health")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
    sub.add_parser("down", help="stop everything").set_defaults(fn=cmd_down)
    sub.add_parser("run", help="run the main job (see `gyre run --help`)")
    sub.add_parser("trajectory", help="`gyre trajectory stats --records FILE.jsonl [--max-paths K]`")
    sub.add_parser("replay", help="train on recorded TITO executions, no engine "
                                  "(`gyre replay --records FILE.jsonl [--max-paths N] [--steps N]`), or play a "
                                  "trace's executions on the live stack (`gyre replay --trace FILE.jsonl`)")
    sub.add_parser("bench", help="`gyre bench scheduler --trace FILE.jsonl --cells N [--json]`")
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from services.common.errors import GyreError

    try:
        return int(args.fn(args, extra) if getattr(args, "takes_extra", False) else args.fn(args))
    except (ValueError, TimeoutError, GyreError) as exc:
        print(f"gyre: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
