"""``gyre run``: the main job, end to end, on real processes — what ``make run`` does.

    gyre run [--mode elastic|colocate|async] [--config deploy/config/run.toml] [--<field> value ...]
    gyre run --compare            the three modes on the same seed and budget, one comparison
    gyre run --model smollm2-135m-instruct --task arith
                                  a real instruct model on multi-turn arithmetic (defaults from
                                  deploy/config/run-arith.toml unless --config is given)

One run, top to bottom (``run_job``):

    build/load the policy (builtin-tiny: warm-started once, cached)
    up: redis-server, trajectory, reward, trainer core, engine cells, gateway, scheduler, cell agents
    held-out evaluation (greedy, through the gateway)            -> baseline pass rate
    open the job's steps (trajectory) ; start the trainer job ; submit the job (scheduler)
    harness processes lease executions -> model calls via gateway -> reward -> trajectory
    watch: scheduler events (steps, switches), cells (roles), trainer (loss) -> live progress
        every `eval_every` published steps: held-out evaluation
    final evaluation ; report directory (report.html, PNGs, metrics.jsonl) ; down

Every service is the same process ``gyre up`` starts (services/launcher.py); this module only
drives the job through the services' public RPCs, as any client would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.common.config import check, fields_doc, load_config, setting
from services.launcher import REPO, Launcher, default_specs, harness_spec

DEFAULT_RUN_CONFIG = REPO / "deploy" / "config" / "run.toml"
# Default config per task family when --config is not given (the services' sections live there too).
TASK_CONFIGS = {"xlong": DEFAULT_RUN_CONFIG, "arith": REPO / "deploy" / "config" / "run-arith.toml"}
TASK_GENERATORS = {"xlong": "xlong-v1", "arith": "arith-v1"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One `gyre run` job; TOML section [run] of --config, then --field flags."""

    mode: str = setting("elastic", "Scheduling mode: elastic, colocate or async.")
    seed: int = setting(0, "Seed of tasks, sampling and training.")
    model: str = setting("builtin-tiny", "Policy: builtin-tiny, smollm2-135m-instruct or a checkpoint dir.")
    task: str = setting("xlong", "Task family: xlong (the built-in XLong repo task) or arith (multi-turn "
                                 "arithmetic chat, for instruct models with a chat template).")
    steps: int = setting(8, "Policy updates.")
    groups_per_step: int = setting(8, "Task groups per step.")
    group_size: int = setting(8, "Executions per group (GRPO group).")
    engines: int = setting(2, "Rollout cells (engine processes); one more cell is the trainer core.")
    harness_concurrency: int = setting(16, "Executions the harness runs at once.")
    staleness_bound: int = setting(1, "Weight versions a rollout may lag (async/elastic; colocate uses 0).")
    execution_timeout_s: float = setting(120.0, "Wall-clock budget of one execution, seconds.")
    timeout_policy: str = setting("partial", "Timed-out executions: partial, zero or exclude.")
    learning_rate: float = setting(1e-3, "AdamW learning rate.")
    temperature: float = setting(1.0, "Rollout sampling temperature.")
    eval_tasks: int = setting(32, "Held-out tasks per evaluation (greedy).")
    eval_every: int = setting(2, "Evaluate after every this many published steps (and at the start and end).")
    eval_concurrency: int = setting(16, "Held-out executions evaluated at once.")
    task_params: str = setting("", "Task difficulty knobs, 'k=v,k=v' (xlong: services/task/spec.py "
                                   "TaskParams; arith: turns, max_operand).")
    time_budget_s: float = setting(900.0, "Stop (and report) after this long even if steps remain.")
    report_dir: str = setting("reports/latest", "Where report.html, PNGs and metrics.jsonl go.")
    data_dir: str = setting(".gyre/run", "Redis data, spool, logs of this run.")
    model_cache_dir: str = setting(".gyre/models", "Built/converted models.")
    torch_threads: int = setting(1, "Threads per engine/trainer process (2 cores: keep 1).")
    quiet: bool = setting(False, "No live progress display (plain log lines instead).")

    def __post_init__(self) -> None:
        check(self.mode in ("elastic", "colocate", "async"), "mode", self.mode, "elastic, colocate or async")
        check(self.task in TASK_GENERATORS, "task", self.task, "xlong or arith")
        check(self.steps >= 1, "steps", self.steps, "at least 1")
        check(self.groups_per_step >= 1, "groups_per_step", self.groups_per_step, "at least 1")
        check(self.group_size >= 2, "group_size", self.group_size, "at least 2 (group-relative advantages)")
        check(self.engines >= 1, "engines", self.engines, "at least 1")
        check(self.harness_concurrency >= 1, "harness_concurrency", self.harness_concurrency, "at least 1")
        check(0 <= self.staleness_bound <= 16, "staleness_bound", self.staleness_bound, "0..16")
        check(self.timeout_policy in ("partial", "zero", "exclude"), "timeout_policy", self.timeout_policy,
              "partial, zero or exclude")
        check(self.eval_tasks >= 0, "eval_tasks", self.eval_tasks, "0 or more")
        check(self.eval_every >= 1, "eval_every", self.eval_every, "at least 1")
        check(self.time_budget_s > 0, "time_budget_s", self.time_budget_s, "positive")
        check(self.learning_rate > 0, "learning_rate", self.learning_rate, "positive")

    @property
    def executions_per_step(self) -> int:
        return self.groups_per_step * self.group_size

    def knobs(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in self.task_params.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"task_params entry {part!r} must look like knob=value")
            out[key.strip()] = value.strip()
        return out


# ---------------------------------------------------------------------------------------- evaluation
class Evaluator:
    """Held-out pass rate with greedy decoding, through the gateway like any harness."""

    def __init__(self, cfg: RunConfig, gateway_address: str, model_dir: Path, job_id: str) -> None:
        from services.rollout.client import GatewayClient
        from services.task.harness import GatewayModelClient
        from services.task.spec import TaskParams, task_from_id, task_ids
        from services.task.tokenizer import Codec

        self.cfg = cfg
        self.job_id = f"{job_id}-eval"
        self.rounds = 0
        self.gateway = GatewayClient(gateway_address, timeout_s=300.0)
        # generous retries: in elastic mode every rollout cell may be training right now
        self.client = GatewayModelClient(self.gateway, retries=40)
        if cfg.task == "arith":
            from transformers import AutoTokenizer

            from services.task.arith import ArithParams

            self.arith_params = ArithParams(**{k: int(v) for k, v in cfg.knobs().items()})
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            return
        knobs = TaskParams(**{k: int(v) for k, v in cfg.knobs().items()})
        self.tasks = [task_from_id(t) for t in task_ids(cfg.eval_tasks, split="heldout", params=knobs)]
        self.codec = Codec.from_dir(str(model_dir)) if (model_dir / "tokenizer.json").exists() else Codec()

    def evaluate(self) -> dict[str, float]:
        self.rounds += 1
        if self.cfg.task == "arith":
            return self._evaluate_arith()
        from services.task.agent import AgentConfig, run_execution
        from services.task.scoring import score_workspace

        agent = AgentConfig(temperature=0.0, timeout_s=self.cfg.execution_timeout_s)

        def one(i: int) -> tuple[bool, float]:
            task = self.tasks[i]
            eid = f"{self.job_id}{self.rounds}-{i}"
            result = run_execution(task, self.client, codec=self.codec, config=agent, job_id=self.job_id,
                                   execution_id=eid)
            self.client.forget(eid)
            score = score_workspace(task, result.files)
            return score.all_passed, score.reward

        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=self.cfg.eval_concurrency) as pool:
            results = list(pool.map(one, range(len(self.tasks))))
        n = max(len(results), 1)
        return {"heldout_pass_rate": sum(p for p, _ in results) / n,
                "heldout_reward": sum(r for _, r in results) / n,
                "eval_s": time.monotonic() - start}

    def _evaluate_arith(self) -> dict[str, float]:
        from services.task.arith import ArithConfig, evaluate

        start = time.monotonic()
        res = evaluate(self.client, self.tokenizer, n=self.cfg.eval_tasks, params=self.arith_params,
                       concurrency=self.cfg.eval_concurrency, job_id=f"{self.job_id}{self.rounds}",
                       config=ArithConfig(temperature=0.0, timeout_s=self.cfg.execution_timeout_s))
        for r in res.results:
            self.client.forget(f"{self.job_id}{self.rounds}/{r.task_id}")
        out = {"heldout_pass_rate": res.accuracy, "heldout_reward": res.mean_reward,
               "eval_s": time.monotonic() - start}
        out.update({f"heldout_turn{k + 1}": acc for k, acc in enumerate(res.turn_accuracy)})
        return out

    def close(self) -> None:
        self.gateway.close()


# ------------------------------------------------------------------------------------------ the job
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


class _Watcher:
    """Follows the job's event log and the cell registry in background threads."""

    def __init__(self, scheduler: Any, job_id: str, t0: float) -> None:
        self.scheduler, self.job_id, self.t0 = scheduler, job_id, t0
        self.switches: list[dict[str, Any]] = []
        self.step_done: dict[int, float] = {}
        self.exec_by_step: dict[int, list[str]] = {}
        self.statuses: dict[str, int] = {}
        self.roles: list[dict[str, Any]] = []
        self._open: dict[str, dict[str, Any]] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._events, daemon=True),
                        threading.Thread(target=self._cells, daemon=True)]
        for t in self.threads:
            t.start()

    def _events(self) -> None:
        last = ""
        while not self.stop.is_set():
            try:
                for ev in self.scheduler.watch(self.job_id, after_event_id=last, follow=True, timeout_s=5.0):
                    last = ev.event_id
                    self._on_event(ev)
                    if self.stop.is_set():
                        return
            except Exception:  # deliberate: the stream times out every 5 s; resume from `last`
                self.stop.wait(0.2)

    def _on_event(self, ev: Any) -> None:
        a = ev.attrs
        with self.lock:
            if ev.kind == "switch_finished":
                self.switches.append({"cell_id": a.get("cell_id"), "from": a.get("from"), "to": a.get("to"),
                                      "duration_s": float(a.get("duration_ms", 0) or 0) / 1000.0,
                                      "at_s": ev.ts_s - self.t0, "migrated": a.get("migrated", "")})
            elif ev.kind == "step_trained":
                self.step_done[ev.attr_int("step")] = ev.ts_s - self.t0
            elif ev.kind == "execution_completed":
                self.exec_by_step.setdefault(ev.attr_int("step"), []).append(a.get("execution_id", ""))
                self.statuses[a.get("status", "?")] = self.statuses.get(a.get("status", "?"), 0) + 1

    def _cells(self) -> None:
        while not self.stop.wait(0.5):
            try:
                cells = self.scheduler.list_cells()
            except Exception:  # deliberate: transient while a service restarts; sample again
                continue
            now = time.time() - self.t0
            with self.lock:
                for info in cells:
                    c = info.cell
                    role = c.role.value if hasattr(c.role, "value") else str(c.role)
                    cur = self._open.get(c.cell_id)
                    if cur is None or cur["role"] != role:
                        if cur is not None:
                            cur["end_s"] = now
                            self.roles.append(cur)
                        self._open[c.cell_id] = {"cell_id": c.cell_id, "role": role, "start_s": now, "end_s": now}
                    else:
                        cur["end_s"] = now

    def close(self) -> list[dict[str, Any]]:
        self.stop.set()
        with self.lock:
            return self.roles + list(self._open.values())


def run_job(cfg: RunConfig, *, echo: Any = print, config_path: str | Path | None = None) -> RunResult:
    """Run one job end to end (see module docstring); always tears the stack down. The services'
    sections come from ``config_path`` (default: the task's config, TASK_CONFIGS)."""
    from services.models.source import resolve_model

    t_build = time.monotonic()
    echo(f"model: {cfg.model} (built or converted once, then cached in {cfg.model_cache_dir})")
    model_dir = resolve_model(cfg.model, cfg.model_cache_dir)
    echo(f"model ready in {time.monotonic() - t_build:.0f}s: {model_dir}")

    job_id = f"run-{cfg.mode}-s{cfg.seed}-{int(time.time())}"
    echo(f"job: {job_id}")
    data_dir = Path(cfg.data_dir).resolve() / cfg.mode
    if data_dir.exists():  # every run starts from an empty Redis, spool and checkpoint dir
        import shutil

        shutil.rmtree(data_dir)
    launcher = Launcher(data_dir, Path(config_path) if config_path else TASK_CONFIGS[cfg.task])
    specs = default_specs(cfg.engines, model=str(model_dir), job_id=job_id, torch_threads=cfg.torch_threads)
    workers = [harness_spec(job_id=job_id, model=str(model_dir), concurrency=cfg.harness_concurrency,
                            extra=("--temperature", str(cfg.temperature)))]
    # MALLOC_ARENA_MAX: glibc gives each thread of a gRPC + torch process its own malloc arena, and
    # freed activations stay resident in them; three 135M-model trainer processes hit the OOM killer
    # on 24 GiB without the cap
    env = {"OMP_NUM_THREADS": str(cfg.torch_threads), "MALLOC_ARENA_MAX": "2",
           "GYRE_MODEL_CACHE": str(Path(cfg.model_cache_dir).resolve())}
    t0 = time.time()
    up = launcher.up(specs, redis_url=os.environ.get("REDIS_URL"), echo=echo, env=env)
    addr = {k: v.address for k, v in up.items()}
    watcher: _Watcher | None = None
    evaluator: Evaluator | None = None
    try:
        from services.scheduler.client import SchedulerClient
        from services.scheduler.jobs import JobSpec, Mode, TaskSource, TimeoutPolicy
        from services.trainer.client import TrainerClient
        from services.trainer.job import TrainerJob
        from services.trainer.learner import OptimConfig
        from services.trajectory.client import TrajectoryClient

        scheduler = SchedulerClient(addr["scheduler"])
        trainer = TrainerClient(addr["trainer"])
        trajectory = TrajectoryClient(addr["trajectory"])
        evaluator = Evaluator(cfg, addr["gateway"], model_dir, job_id)
        evals: list[dict[str, Any]] = []

        def evaluate(step: int) -> None:
            if cfg.eval_tasks == 0:
                return
            res = evaluator.evaluate()  # type: ignore[union-attr]
            evals.append({"step": step, "time_s": time.time() - t0, **res})
            echo(f"held-out after {step} steps: pass rate {res['heldout_pass_rate']:.3f} "
                 f"(reward {res['heldout_reward']:.3f}, {res['eval_s']:.0f}s)")

        evaluate(0)
        for s in range(cfg.steps):
            trajectory.open_step(job_id, s, num_executions=cfg.executions_per_step, group_size=cfg.group_size)
        trainer.start_job(TrainerJob(
            job_id=job_id, model=str(model_dir), model_cache_dir=cfg.model_cache_dir, source="trajectory",
            trajectory_address=addr["trajectory"],
            engine_addresses=tuple(addr[f"engine-{i + 1}"] for i in range(cfg.engines)),
            scheduler_address=addr["scheduler"], num_steps=cfg.steps, temperature=cfg.temperature,
            seed=cfg.seed, optim=OptimConfig(lr=cfg.learning_rate),
            checkpoint_dir=str(data_dir / "checkpoints")))
        from services.reward.client import RewardClient
        from services.reward.scorers import ScorerSpec

        with RewardClient(addr["reward"]) as reward:  # the task family's own scorer, the run's policy
            reward.configure_job(job_id, ScorerSpec(kind="builtin", target=TASK_GENERATORS[cfg.task]),
                                 timeout_policy=cfg.timeout_policy)
        params = {"split": "train", "start_seed": str(cfg.seed * 100_000), **cfg.knobs()}
        spec = JobSpec(
            job_id=job_id, model=str(model_dir),
            tasks=TaskSource(generator=TASK_GENERATORS[cfg.task], params=tuple(params.items())),
            num_steps=cfg.steps, groups_per_step=cfg.groups_per_step, group_size=cfg.group_size,
            mode=Mode(cfg.mode), staleness_bound=0 if cfg.mode == "colocate" else cfg.staleness_bound,
            timeout_policy=TimeoutPolicy(cfg.timeout_policy), execution_timeout_s=cfg.execution_timeout_s,
            async_rollout_cells=cfg.engines if cfg.mode == "async" else None)
        scheduler.submit_job(spec)
        watcher = _Watcher(scheduler, job_id, t0)
        launcher.start_workers(workers, addr, env=env, echo=echo)
        state = _follow(cfg, scheduler, trainer, trajectory, watcher, job_id, t0, evaluate, echo,
                        exited=launcher.exited)
        last_step = max(watcher.step_done, default=-1) + 1
        if not evals or evals[-1]["step"] != last_step:
            # The job is over: elastic may have left every cell training. Make the engines routable
            # again (the gateway remembers their addresses) so the final evaluation can run.
            for i in range(cfg.engines):
                try:
                    evaluator.gateway.register_engine(f"cell-{i + 1}", "")
                except Exception:  # deliberate: already registered (AlreadyExists) is fine
                    pass
            evaluate(last_step)
        steps = _step_rows(trajectory, trainer, watcher, job_id)
        roles = watcher.close()
        migrations = _scrape(up["gateway"].metrics_port, "gyre_rollout_gateway_migrations_total", "transport")
        weight_version = scheduler.get_job(job_id).weight_version
        meta = {"mode": cfg.mode, "seed": cfg.seed, "model": cfg.model, "task": cfg.task, "job": job_id,
                "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch CPU",
                "migrations (by transport)": json.dumps(migrations),
                "config": json.dumps(dataclasses.asdict(cfg))}
        from services.report import write_report

        report = write_report(cfg.report_dir, steps=steps, evals=evals, roles=roles, switches=watcher.switches,
                              meta=meta)
        echo(f"report: {report}")
        return RunResult(job_id, cfg.mode, steps, evals, roles, watcher.switches, time.time() - t0, report, state,
                         migrations, weight_version, dict(watcher.statuses))
    finally:
        if watcher is not None:
            watcher.close()
        if evaluator is not None:
            evaluator.close()
        launcher.down(echo=lambda _m: None)


def _follow(cfg: RunConfig, scheduler: Any, trainer: Any, trajectory: Any, watcher: _Watcher, job_id: str,
            t0: float, evaluate: Any, echo: Any, exited: Any = None) -> str:
    """Live progress until the job ends or the time budget runs out; returns the final job state.
    ``exited()`` -> {name: log tail} of service or worker processes that died (a crash, the OOM
    killer): the run stops with that news instead of waiting out its time budget."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    console = Console(stderr=False)
    evaluated_at = 0
    deadline = t0 + cfg.time_budget_s

    def table(job: Any) -> Table:
        t = Table(title=f"gyre run  {job_id}  ({cfg.mode})", show_header=False)
        done_steps = len(watcher.step_done)
        per = cfg.executions_per_step
        t.add_row("step", _bar(done_steps, cfg.steps) + f" {done_steps}/{cfg.steps}  (weight version {job.weight_version})")
        t.add_row("executions", _bar(job.done_in_step, per) + f" {job.done_in_step}/{per} of step {job.current_step}, "
                  f"{job.running} in flight, {job.queued} queued")
        roles: dict[str, int] = {}
        with watcher.lock:
            for c in watcher._open.values():
                roles[c["role"]] = roles.get(c["role"], 0) + 1
            switches = len(watcher.switches)
        t.add_row("cells", ", ".join(f"{n} {r}" for r, n in sorted(roles.items())) + f"   switches: {switches}")
        t.add_row("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(watcher.statuses.items())) or "-")
        t.add_row("elapsed", f"{time.time() - t0:.0f}s of {cfg.time_budget_s:.0f}s budget")
        return t

    job = scheduler.get_job(job_id)
    live = None if cfg.quiet or not console.is_terminal else Live(table(job), console=console, refresh_per_second=2)
    last_line = 0.0
    if live is not None:
        live.start()
    try:
        while True:
            job = scheduler.get_job(job_id)
            state = job.state.value if hasattr(job.state, "value") else str(job.state)
            if live is not None:
                live.update(table(job))
            elif time.time() - last_line > 10:
                last_line = time.time()
                echo(f"[{time.time() - t0:5.0f}s] step {len(watcher.step_done)}/{cfg.steps} "
                     f"v{job.weight_version} done {job.done_in_step}/{cfg.executions_per_step} "
                     f"running {job.running} queued {job.queued} switches {len(watcher.switches)} "
                     f"outcomes {dict(watcher.statuses)}")
            if state in ("succeeded", "failed", "cancelled") or len(watcher.step_done) >= cfg.steps:
                return state
            dead = exited() if exited is not None else {}
            if dead:
                name, tail = next(iter(dead.items()))
                try:
                    scheduler.cancel_job(job_id, f"the {name} process exited")
                except Exception:  # deliberate: the scheduler may be the process that died
                    pass
                raise RuntimeError(f"the {name} process exited, so the job cannot go on (see its log; `dmesg` "
                                   f"shows whether the OOM killer ended it); its log ends with:\n{tail}")
            if time.time() > deadline:
                echo(f"time budget of {cfg.time_budget_s:.0f}s reached; stopping the job")
                scheduler.cancel_job(job_id, "time budget reached")
                return "budget"
            published = len(watcher.step_done)
            if published - evaluated_at >= cfg.eval_every and published < cfg.steps:
                evaluated_at = published
                evaluate(published)
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()


def _scrape(port: int | None, metric: str, label: str) -> dict[str, float]:
    """One labelled counter from a service's Prometheus endpoint: {label value: count}."""
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
            if sample.name == metric:
                out[sample.labels.get(label, "")] = sample.value
    return out


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * min(done, total) / max(total, 1))
    return "█" * filled + "░" * (width - filled)


def _step_rows(trajectory: Any, trainer: Any, watcher: _Watcher, job_id: str) -> list[dict[str, Any]]:
    rows = []
    for step in sorted(watcher.step_done):
        naive = tree = 0
        for eid in watcher.exec_by_step.get(step, []):
            try:
                st = trajectory.execution_stats(eid, job_id=job_id)
            except Exception:  # deliberate: an execution without records (failed early) has no stats
                continue
            naive += st.naive_tokens
            tree += st.tree_tokens
        row: dict[str, Any] = {"step": step, "time_s": watcher.step_done[step], "naive_tokens": naive,
                               "tree_tokens": tree}
        try:
            report = trainer.wait_step(step, timeout_s=1.0)
            row.update({k: float(v) for k, v in report.metrics.items()})
        except Exception:  # deliberate: metrics are optional in the report
            pass
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ CLI
def load_run_config(argv: Sequence[str]) -> tuple[RunConfig, Path]:
    """``[--config FILE] [--field value ...]`` -> (config, the file the services are configured from).

    Without --config the task's own file is used (TASK_CONFIGS: ``--task arith`` reads
    deploy/config/run-arith.toml), so its defaults (model size, learning rate) fit the task.
    """
    args = list(argv)
    path: Path | None = None
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ValueError("--config needs a file")
        path = Path(args[i + 1])
        del args[i:i + 2]
    cfg = load_config(RunConfig, path=str(path or DEFAULT_RUN_CONFIG), section="run", env_prefix="GYRE_RUN_",
                      argv=args)
    if path is None:
        path = TASK_CONFIGS[cfg.task]
        if path != DEFAULT_RUN_CONFIG:  # the task's own defaults, then the same flags on top
            cfg = load_config(RunConfig, path=str(path), section="run", env_prefix="GYRE_RUN_", argv=args)
    return cfg, path


def run_main(argv: Sequence[str]) -> int:
    args = list(argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        for name, tname, default, doc in fields_doc(RunConfig):
            print(f"  --{name.replace('_', '-'):<22} {tname:<6} default {default!r}: {doc}")
        return 0
    compare = "--compare" in args
    if compare:
        args.remove("--compare")
    try:
        cfg, path = load_run_config(args)
    except ValueError as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    from services.common.logging import setup_logging

    setup_logging(json=True, level="WARNING", service="run")
    import signal

    def _interrupt(_signum: int, _frame: Any) -> None:
        # Unwinds run_job's finally, which takes the stack down. Later signals are ignored: a
        # second SIGTERM/^C (from `timeout`, a process-group kill, an impatient user) must not
        # interrupt that teardown and leave every service running (they run in their own sessions).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        if compare:
            from services.compare import compare_modes

            compare_modes(cfg)
            return 0
        result = run_job(cfg, config_path=path)
    except (ValueError, TimeoutError, RuntimeError) as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gyre run: interrupted; every service it started was stopped", file=sys.stderr)
        return 130
    first, last = (result.evals[0], result.evals[-1]) if result.evals else ({}, {})
    print(json.dumps({"job_id": result.job_id, "mode": result.mode, "state": result.final_state,
                      "steps": len(result.steps), "wall_s": round(result.wall_s, 1),
                      "heldout_pass_rate_first": first.get("heldout_pass_rate"),
                      "heldout_pass_rate_last": last.get("heldout_pass_rate"),
                      "switches": len(result.switches), "migrations": result.migrations,
                      "outcomes": result.outcomes,
                      "report": str(result.report)}))
    return 0
