"""``gyre run``: the main job, end to end, on real processes — what ``make run`` does.

    gyre run [--job deploy/config/job.toml] [--config deploy/config/run.toml] [--<job field> value ...]
    gyre run --mode colocate --num-steps 4 --algorithm.learning-rate 3e-4
    gyre run --model smollm2-135m-instruct --task arith     (job-arith.toml + run-arith.toml)
    gyre run --task tools        (job-tools.toml: builtin-tools on xlong-tools-v1, the task as tool calls)
    gyre run --harness openai-agents     (the same job, each execution run by an openai-agents Agent)

It is a client of the scheduler's job API and nothing else (``run_job``)::

    up        redis-server + every service + the built-in harness (``gyre up``'s stack)
    submit    the job file's [job] (a JobSpec) -> Scheduler.SubmitJob      (``gyre submit``)
    watch     Scheduler.WatchJob until the job ends, live progress          (``gyre watch``)
    report    report.html, figures, metrics.jsonl from the job's events     (``gyre report``)
    policy    <report_dir>/policy: the trained policy as a model directory (``save_policy``)
    down

The scheduler does the rest: it opens the steps, starts the trainer, configures reward, runs the
held-out evaluations and publishes every event. The one thing read from the run's own data dir
rather than through the API is the trainer's last checkpoint, which ``policy`` copies out before
the next run (which starts from an empty data dir) would delete it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.common.config import check, fields_doc, load_config, setting
from services.jobwatch import JobView, follow, write_job_report
from services.launcher import REPO, Launcher, default_specs, harness_spec
from services.scheduler.jobfile import DEFAULT_JOB_FILE, load_job
from services.scheduler.jobs import HARNESSES, JobSpec
from services.task.loops import LOOPS
from services.supervisor import Supervisor

DEFAULT_RUN_CONFIG = REPO / "deploy" / "config" / "run.toml"
# Files per task family when --job / --config are not given (the job, then the stack it runs on).
TASK_FILES = {"xlong": (DEFAULT_JOB_FILE, DEFAULT_RUN_CONFIG),
              "arith": (REPO / "deploy" / "config" / "job-arith.toml", REPO / "deploy" / "config" / "run-arith.toml"),
              "tools": (REPO / "deploy" / "config" / "job-tools.toml", REPO / "deploy" / "config" / "run-tools.toml")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The stack one `gyre run` brings up (TOML [run] of --config); the job itself is the job file."""

    engines: int = setting(2, "Rollout cells (engine processes); one more cell is the trainer core.")
    harness_concurrency: int = setting(16, "Executions the built-in harness runs at once.")
    time_budget_s: float = setting(900.0, "Cancel the job (and report) after this long.")
    report_dir: str = setting("reports/latest", "Where report.html, PNGs and metrics.jsonl go.")
    data_dir: str = setting(".gyre/run", "Redis data, spool, checkpoints and logs of this run.")
    model_cache_dir: str = setting(".gyre/models", "Built/converted models.")
    torch_threads: int = setting(1, "Threads per engine/trainer process (2 cores: keep 1).")
    quiet: bool = setting(False, "No live progress display (plain log lines instead).")
    save_policy: bool = setting(True, "Write the trained policy to <report_dir>/policy (a model directory: "
                                      "`gyre run --model DIR` trains on from it).")
    logger: str = setting("", "Experiment trackers that log every step's figures from the job's events, comma-"
                              "separated: tensorboard (<report_dir>/tensorboard), wandb (offline in "
                              "<report_dir>/wandb unless WANDB_MODE says otherwise), mlflow (a file store in "
                              "<report_dir>/mlruns unless MLFLOW_TRACKING_URI is set).")
    harness_loop: str = setting("builtin", "Agent loop the built-in harness runs tool-calling tasks with: builtin, "
                                           "openai-agents, smolagents, mini-swe-agent, claude-code or codex (`--harness "
                                           "NAME` sets it and, "
                                           "without --task or --job, picks --task tools).")

    def __post_init__(self) -> None:
        check(self.engines >= 1, "engines", self.engines, "at least 1")
        check(self.harness_concurrency >= 1, "harness_concurrency", self.harness_concurrency, "at least 1")
        check(self.time_budget_s > 0, "time_budget_s", self.time_budget_s, "positive")
        check(self.harness_loop in LOOPS, "harness_loop", self.harness_loop, " or ".join(LOOPS))
        from services.tracking import LOGGERS, parse_loggers

        try:
            parse_loggers(self.logger)
        except ValueError:
            check(False, "logger", self.logger, "a comma-separated list of " + ", ".join(LOGGERS))


@dataclasses.dataclass
class RunResult:
    job_id: str
    mode: str
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    roles: list[dict[str, Any]]
    switches: list[dict[str, Any]]
    wall_s: float
    report: Path | None
    final_state: str
    migrations: dict[str, float] = dataclasses.field(default_factory=dict)
    weight_version: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)  # executions by end status
    policy: Path | None = None  # the trained policy's model directory (save_policy), if one was written


def bring_up(launcher: Launcher, run: RunConfig, model: str, *, echo: Callable[[str], None],
             job_id: str = "") -> tuple[dict[str, Any], Path, dict[str, str]]:
    """``gyre up``'s stack for ``model``: services, cells and the built-in harness (which leases
    any running job's executions, or only ``job_id``'s). Returns (running, model dir, env)."""
    from services.models.source import resolve_model

    t = time.monotonic()
    echo(f"model: {model} (built or converted once, then cached in {run.model_cache_dir})")
    model_dir = resolve_model(model, run.model_cache_dir).resolve()
    echo(f"model ready in {time.monotonic() - t:.0f}s: {model_dir}")
    # MALLOC_ARENA_MAX: glibc gives each thread of a gRPC + torch process its own malloc arena, and
    # freed activations stay resident in them; three 135M-model trainer processes hit the OOM killer
    # on 24 GiB without the cap
    # GYRE_GATEWAY_HTTP_PORT: the gateway serves the OpenAI/Anthropic-style endpoint external
    # harnesses use, on a free port (`gyre status --json`: services.gateway.http)
    env = {"OMP_NUM_THREADS": str(run.torch_threads), "MALLOC_ARENA_MAX": "2",
           "GYRE_MODEL_CACHE": str(Path(run.model_cache_dir).resolve()), "GYRE_GATEWAY_HTTP_PORT": "0"}
    # engines and the gateway get the spec itself (they resolve names; a job naming the same spec
    # needs no reload), the harness the directory (its tokenizers)
    spec_or_dir = model if not Path(model).expanduser().is_dir() else str(model_dir)
    specs = default_specs(run.engines, model=spec_or_dir, torch_threads=run.torch_threads)
    up = launcher.up(specs, redis_url=os.environ.get("REDIS_URL"), echo=echo, env=env)
    addresses = {k: v.address for k, v in up.items()}
    harness_id = f"{socket.gethostname()}:{launcher.data_dir}:harness"  # one per stack, stable across restarts
    launcher.start_harnesses([harness_spec(job_id=job_id, model=str(model_dir), concurrency=run.harness_concurrency,
                                         harness_id=harness_id, extra=("--loop", run.harness_loop))],
                           addresses, env=env, echo=echo)
    return up, model_dir, env


def run_job(run: RunConfig, spec: JobSpec, *, echo: Callable[[str], None] = print,
            config_path: str | Path = DEFAULT_RUN_CONFIG) -> RunResult:
    """Up, submit, watch, report, down (see module docstring); always takes the stack down."""
    from services.scheduler.client import SchedulerClient

    data_dir = Path(run.data_dir).resolve() / spec.mode.value
    if data_dir.exists():  # every run starts from an empty Redis, spool and checkpoint dir
        import shutil

        shutil.rmtree(data_dir)
    launcher = Launcher(data_dir, Path(config_path))
    t0 = time.time()
    stop_supervising = threading.Event()
    supervising: threading.Thread | None = None
    try:
        up, model_dir, _env = bring_up(launcher, run, spec.model, echo=echo)
        # whatever dies (a crash, the OOM killer) is started again; the job goes on
        supervisor = Supervisor(launcher.state_file, echo=echo)
        supervising = supervisor.start_thread(stop_supervising)
        scheduler = SchedulerClient(up["scheduler"].address)
        job = scheduler.submit_job(spec)
        echo(f"job: {job.job_id}")
        view = JobView(job.job_id)
        from services.tracking import Trackers

        trackers = Trackers.open(run.logger, run.report_dir, job_id=job.job_id, config=spec.to_dict())
        try:
            state = _watch(run, scheduler, view, t0, echo, failed=supervisor.failed,
                           log_path=launcher.data_dir / "logs" / "gyre-run.log", trackers=trackers)
        finally:
            trackers.close()
        if run.logger:
            echo(f"trackers: {run.logger} ({trackers.logged} step figures) in {run.report_dir}")
        migrations = _scrape(up["gateway"].metrics_port, "gyre_rollout_gateway_migrations_total", "transport")
        prompt = _scrape(up["gateway"].metrics_port, "gyre_rollout_gateway_job_prompt_tokens_total", "kind",
                         where={"job_id": job.job_id})
        reuse = (f"{prompt.get('cached', 0):,.0f} of {prompt.get('prompt', 0):,.0f} prompt tokens "
                 f"({prompt.get('cached', 0) / max(prompt.get('prompt', 0), 1):.1%}) came from engines' prefix caches")
        echo(f"prefix reuse: {reuse}")
        usage = view.usage()
        if usage is not None:
            from services.jobwatch import usage_line

            echo(f"model calls: {usage_line(usage)}")
        from services.trainer.client import TrainerClient
        from services.trajectory.client import TrajectoryClient

        with TrainerClient(up["trainer"].address) as trainer, TrajectoryClient(up["trajectory"].address) as traj:
            meta = {"hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch CPU",
                    "migrations (by transport)": json.dumps(migrations),
                    "prefix reuse": reuse,
                    "stack": json.dumps(dataclasses.asdict(run))}
            report = write_job_report(view, run.report_dir, scheduler=scheduler, trainer=trainer, trajectory=traj,
                                      meta=meta)
            from services.jobwatch import step_rows

            steps = step_rows(view, trainer=trainer, trajectory=traj)
        echo(f"report: {report}")
        weight_version = scheduler.get_job(job.job_id).weight_version
        policy = None
        if run.save_policy:
            policy = save_policy(launcher.data_dir / "spool" / "checkpoints" / job.job_id, model_dir,
                                 Path(run.report_dir) / "policy", job_id=job.job_id)
            info = json.loads((policy / POLICY_FILE).read_text()) if policy else {}
            echo(f"policy: {policy} (weight version {info['weight_version']}; `gyre run --model {policy}` trains on "
                 f"from it)" if policy else "policy: none (the job trained no step)")
        roles = view.roles(time.time() - view.t0, scheduler.list_cells())
        scheduler.close()
        return RunResult(job.job_id, spec.mode.value, steps, view.evals, roles, view.switches, time.time() - t0,
                         report, state, migrations, weight_version, dict(view.outcomes), policy)
    finally:
        stop_supervising.set()
        if supervising is not None:
            supervising.join(30)
        launcher.down(echo=lambda _m: None)


POLICY_FILE = "gyre_policy.json"


def save_policy(checkpoints: Path, base: Path, out: Path, *, job_id: str) -> Path | None:
    """The job's trained policy as the model directory ``out``: ``base``'s config, tokenizer and
    generation files with the weights of the newest complete trainer checkpoint under
    ``checkpoints`` (``<data dir>/spool/checkpoints/<job id>``), and ``gyre_policy.json`` (job, weight
    version, base model, checkpoint; ``base_policy``: the base's own record when it was a policy).
    Any model loader reads it (``gyre run --model out``, ``transformers.AutoModelForCausalLM
    .from_pretrained``, ``bench.bench_heldout_kinds --checkpoint out``). Returns None when the job
    left no checkpoint (it trained no step). Written beside ``out`` and renamed into place (a
    previous policy there is replaced): ``out`` is never half-written."""
    import shutil

    from safetensors.torch import save_file

    from services.trainer.checkpoint import latest_checkpoint, load_weights

    found = latest_checkpoint(checkpoints)
    if found is None:
        return None
    state = json.loads((found / "state.json").read_text())
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():  # the base model's weights and its build record are not the policy's
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")) \
                and f.name not in ("gyre_build.json", POLICY_FILE):
            shutil.copy2(f, tmp / f.name)
    # the checkpoint's tensors with the metadata transformers' loader expects of a model file
    # whatever number of trainer ranks saved them (a tensor of its own per name: tied ones too)
    save_file(load_weights(found), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    info: dict[str, Any] = {"job_id": job_id, "weight_version": int(state["version"]), "base_model": str(base),
                            "checkpoint": str(found)}
    if (base / POLICY_FILE).is_file():  # trained on from an earlier policy: keep its lineage
        info["base_policy"] = json.loads((base / POLICY_FILE).read_text())
    (tmp / POLICY_FILE).write_text(json.dumps(info, indent=1) + "\n")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _watch(run: RunConfig, scheduler: Any, view: JobView, t0: float, echo: Callable[[str], None],
           failed: Callable[[], dict[str, dict[str, str]]] | None = None, log_path: Path | None = None,
           trackers: Any = None) -> str:
    """Live progress until the job ends or the budget runs out; returns the job's final state
    (this command's own log lines go to ``log_path`` while the live table shows; every event also
    goes to ``trackers``). ``failed()`` -> processes whose restart budget is spent: the run stops
    with that news."""
    from services.progress import Progress

    deadline = t0 + run.time_budget_s
    dead: dict[str, dict[str, str]] = {}

    def stop() -> bool:
        nonlocal dead
        dead = failed() if failed is not None else {}
        return bool(dead) or time.time() > deadline

    with Progress(scheduler, view, quiet=run.quiet, echo=echo, log_path=log_path) as progress:
        for ev in follow(scheduler, view, stop=stop, poll_s=1.0):
            if trackers is not None:
                trackers.add(ev)
            progress.update()
        progress.update(force=True)
    if dead:
        name, info = next(iter(dead.items()))
        try:
            scheduler.cancel_job(view.job_id, f"the {name} process keeps dying")
        except Exception:  # deliberate: the scheduler may be the process that died
            pass
        raise RuntimeError(f"the {name} process keeps dying ({info['reason']}), so the job cannot go on (see its "
                           f"log; `dmesg` shows whether the OOM killer ended it); its log ends with:\n"
                           f"{info['log_tail']}")
    if not view.ended:
        echo(f"time budget of {run.time_budget_s:.0f}s reached; cancelling the job")
        scheduler.cancel_job(view.job_id, "time budget reached")
        return "budget"
    return view.state


def _scrape(port: int | None, metric: str, label: str, *, where: dict[str, str] | None = None) -> dict[str, float]:
    """One labelled counter from a service's Prometheus endpoint: {label value: count}, over the
    samples whose other labels match ``where``."""
    if not port:
        return {}
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in (where or {}).items()):
                out[sample.labels.get(label, "")] = sample.value
    return out


# ------------------------------------------------------------------------------------------ CLI
RUN_FLAGS = {f.name for f in dataclasses.fields(RunConfig)}


def split_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(``--job``/``--config``/``--task`` files, RunConfig flags, job flags) of a command line."""
    files: dict[str, str] = {}
    run_args: list[str] = []
    job_args: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        flag = args[i]
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if name == "quiet":
            run_args += [flag, "true"] if i + 1 >= len(args) or args[i + 1].startswith("--") else args[i:i + 2]
            i += 1 if i + 1 >= len(args) or args[i + 1].startswith("--") else 2
            continue
        if i + 1 >= len(args):
            raise ValueError(f"{flag} needs a value")
        if name in ("job", "config", "task"):
            files[name] = args[i + 1]
        elif name == "harness" and args[i + 1] not in HARNESSES:  # a loop the built-in harness runs
            if args[i + 1] not in LOOPS:
                raise ValueError(f"--harness {args[i + 1]!r} is not available; expected {', '.join(LOOPS[1:])} (an "
                                 f"agent loop run on the task's tools) or {' or '.join(HARNESSES)} (who runs the "
                                 "job's executions)")
            run_args += ["--harness-loop", args[i + 1]]
        elif name in RUN_FLAGS:
            run_args += args[i:i + 2]
        else:
            job_args += args[i:i + 2]
        i += 2
    return files, run_args, job_args


def load_run(argv: Sequence[str]) -> tuple[RunConfig, JobSpec, Path]:
    """The stack config, the job spec and the services' config file of a ``gyre run`` command line."""
    files, run_args, job_args = split_args(argv)
    third_party = "--harness-loop" in run_args and run_args[run_args.index("--harness-loop") + 1] != "builtin"
    task = files.get("task", "tools" if third_party and "job" not in files else "xlong")
    if task not in TASK_FILES:
        raise ValueError(f"--task {task!r} is unknown; expected {' or '.join(TASK_FILES)}")
    job_file, config = TASK_FILES[task]
    job_file = Path(files.get("job", job_file))
    config = Path(files.get("config", config))
    run = load_config(RunConfig, path=str(config), section="run", env_prefix="GYRE_RUN_", argv=run_args)
    spec = load_job(job_file, job_args)
    return run, spec, config


def interrupt_on_signals() -> None:
    """SIGTERM and ^C raise KeyboardInterrupt, which unwinds ``run_job``'s finally: the stack comes
    down. Later signals are ignored: a second SIGTERM/^C (from `timeout`, a process-group kill, an
    impatient user) must not interrupt that teardown and leave every service running (they run in
    their own sessions)."""
    import signal

    def _interrupt(_signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def run_job_cli(run: RunConfig, spec: JobSpec, config: Path, *, prog: str) -> RunResult | int:
    """``run_job`` for a command: JSON warnings only, SIGTERM/^C take the stack down; the result, or
    the exit code after one sentence on stderr (2: the job could not run, 130: interrupted)."""
    from services.common.logging import setup_logging

    setup_logging(json=True, level="WARNING", service=prog.split()[-1])
    interrupt_on_signals()
    try:
        return run_job(run, spec, config_path=config)
    except (ValueError, TimeoutError, RuntimeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every service it started was stopped", file=sys.stderr)
        return 130


def run_main(argv: Sequence[str]) -> int:
    args = list(argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        print("Stack ([run] of --config):")
        for name, tname, default, doc in fields_doc(RunConfig):
            print(f"  --{name.replace('_', '-'):<22} {tname:<6} default {default!r}: {doc}")
        print("Job: any field of the job file's [job] (see deploy/config/job.toml), e.g. --mode, --num-steps, "
              "--algorithm.learning-rate, --evaluation.tasks, --tasks.params.KEY")
        return 0
    try:
        run, spec, config = load_run(args)
    except ValueError as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    result = run_job_cli(run, spec, config, prog="gyre run")
    if isinstance(result, int):
        return result
    first, last = (result.evals[0], result.evals[-1]) if result.evals else ({}, {})
    print(json.dumps({"job_id": result.job_id, "mode": result.mode, "state": result.final_state,
                      "steps": len(result.steps), "wall_s": round(result.wall_s, 1),
                      "heldout_pass_rate_first": first.get("heldout_pass_rate"),
                      "heldout_pass_rate_last": last.get("heldout_pass_rate"),
                      "weight_version": result.weight_version,
                      "switches": len(result.switches), "migrations": result.migrations,
                      "outcomes": result.outcomes, "report": str(result.report)}))
    return 0 if result.final_state == "completed" else 1
