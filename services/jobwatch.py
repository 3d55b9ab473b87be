"""A client's view of one job, built only from the scheduler's public API (``WatchJob``, ``GetJob``).

``JobView`` folds the job's event log into what a person or a report needs: steps published (with
their weight versions and times), executions by end status and step, evaluations, cell switches
and role intervals. ``gyre watch`` (live progress or JSON lines), ``gyre run`` and ``gyre report``
all use it, so a report can be made of any job, including one somebody else submitted::

    view = JobView(job_id)
    for event in scheduler.watch(job_id, follow=True):   # resumable by event id
        view.add(event)
    write_job_report(view, out_dir, scheduler=..., trainer=..., trajectory=...)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TERMINAL = ("completed", "failed", "cancelled")
USAGE_KEYS = ("calls", "calls_in_flight", "prompt_tokens", "cached_tokens", "output_tokens", "max_context",
              "last_context")


def training_line(t: dict[str, float]) -> str:
    """One line of the trainer's last published step (``JobView.last_training``) for people: its
    loss, tokens/s, the world of its all-reduce and, for a sharded trainer, each rank's peak RSS."""
    parts = [f"loss {t.get('loss', 0.0):.4f}", f"{t.get('tokens_per_s', 0.0):,.0f} tok/s",
             f"world {t.get('world_size', 1):.0f}"]
    shards = int(t.get("shards", 1))
    if shards > 1:
        rss = [t.get(f"peak_rss_mib_rank{r}") for r in range(shards)]
        parts.append(f"{shards} ranks, peak RSS " + ", ".join("?" if v is None else f"{v:,.0f}" for v in rss) + " MiB")
    return ", ".join(parts)


def usage_line(u: dict[str, float]) -> str:
    """One line of a job's model calls (``JobView.usage()``) for people."""
    rate = (f", {u['output_tok_s']:,.0f} tok/s generated, {u['prefill_tok_s']:,.0f} tok/s prefilled"
            if "output_tok_s" in u else "")
    return (f"{u['calls']:,.0f} calls ({u['calls_in_flight']:,.0f} in flight), context {u['last_context']:,.0f} "
            f"(max {u['max_context']:,.0f}), {u['prompt_tokens']:,.0f} prompt tokens of which {u['reuse']:.1%} "
            f"reused from prefix caches, {u['output_tokens']:,.0f} generated{rate}")


@dataclass
class JobView:
    job_id: str
    t0: float = 0.0  # time of the first event (job submitted)
    last_event_id: str = ""
    state: str = "pending"
    message: str = ""
    weight_version: int = 0
    steps: dict[int, float] = field(default_factory=dict)  # step -> seconds since t0 when published
    exec_by_step: dict[int, list[str]] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    done_by_step: dict[int, int] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    migrations: dict[str, int] = field(default_factory=dict)  # requests migrated, by KV transport
    _open_switch: dict[str, dict[str, Any]] = field(default_factory=dict)
    _phases: dict[str, dict[str, float]] = field(default_factory=dict)
    role_spans: list[dict[str, Any]] = field(default_factory=list)
    _role_at: dict[str, tuple[str, float]] = field(default_factory=dict)
    last_metrics: dict[str, str] = field(default_factory=dict)
    # the trainer's figures of the last published step (its step_trained event's trainer.<name>)
    last_training: dict[str, float] = field(default_factory=dict)
    # the job's model calls, from the gateway's totals in 'metrics' events (``usage()``)
    _usage: tuple[float, dict[str, int]] | None = None
    _usage_before: tuple[float, dict[str, int]] | None = None

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    def add(self, ev: Any) -> None:
        """Fold one event (services.scheduler.jobs.Event) into the view."""
        if not self.t0:
            self.t0 = ev.ts_s
        self.last_event_id = ev.event_id
        a, at = ev.attrs, ev.ts_s - self.t0
        kind = ev.kind
        if kind == "job_state":
            self.state, self.message = a.get("state", self.state), a.get("message", "")
        elif kind == "step_trained":
            self.steps[int(a["step"])] = at
            self.weight_version = max(self.weight_version, int(a.get("weight_version", 0) or 0))
            figures = {k[len("trainer."):]: float(v) for k, v in a.items() if k.startswith("trainer.")}
            if figures:
                self.last_training = figures
        elif kind == "execution_completed":
            status = a.get("status", "?")
            if a.get("evaluation"):
                return
            step = int(a.get("step", -1))
            self.exec_by_step.setdefault(step, []).append(a.get("execution_id", ""))
            self.outcomes[status] = self.outcomes.get(status, 0) + 1
            self.done_by_step[step] = self.done_by_step.get(step, 0) + 1
        elif kind == "evaluation":
            self.evals.append({"step": int(a["after_step"]), "time_s": at, "round": int(a["round"]),
                               "weight_version": int(a.get("weight_version", 0) or 0),
                               "heldout_pass_rate": float(a["pass_rate"]), "heldout_reward": float(a["mean_reward"]),
                               "tasks": int(a.get("tasks", 0) or 0), "statuses": json.loads(a.get("statuses") or "{}")})
            self.evals.sort(key=lambda e: e["round"])  # a later round may be scored first (its tasks ran faster)
        elif kind == "switch_started":
            cell = a.get("cell_id", "")
            self._role(cell, a.get("from", ""), "switching", at)
            self._open_switch[cell] = {"reason": a.get("reason", "")}
        elif kind in ("switch_finished", "switch_rolled_back"):
            cell = a.get("cell_id", "")
            started = self._open_switch.pop(cell, {})
            done = kind == "switch_finished"
            self._role(cell, "switching", a.get("to" if done else "from", ""), at)
            phases = self._phases.pop(cell, {})
            if done:
                self.switches.append({"cell_id": cell, "from": a.get("from"), "to": a.get("to"),
                                      "duration_s": float(a.get("duration_ms", 0) or 0) / 1000.0, "at_s": at,
                                      "reason": started.get("reason", ""), "phases": phases})
        elif kind == "switch_phases":  # logged just before its switch_finished
            self._phases[a.get("cell_id", "")] = json.loads(a.get("phases") or "{}")
        elif kind == "migration":
            for transport, n in json.loads(a.get("transports") or "{}").items():
                self.migrations[transport] = self.migrations.get(transport, 0) + int(n)
        elif kind == "metrics":
            self.last_metrics = dict(a)
            if "calls" in a:
                self._usage_before, self._usage = self._usage, (ev.ts_s, {k: int(a.get(k, 0) or 0) for k in USAGE_KEYS})
        elif kind == "controller_error":
            self.errors.append(f"{a.get('stage', '?')}: {a.get('error', '')}")

    def usage(self) -> dict[str, float] | None:
        """The job's model calls so far (every call through the gateway, any harness): calls,
        calls_in_flight, prompt / cached / output tokens, max_context, last_context, reuse (cached /
        prompt), and, once two snapshots came, output_tok_s and prefill_tok_s (new prompt tokens
        computed per second) between them; None before the job's first call."""
        if self._usage is None:
            return None
        at, u = self._usage
        out: dict[str, float] = {**u, "reuse": u["cached_tokens"] / max(u["prompt_tokens"], 1)}
        if self._usage_before is not None and at > self._usage_before[0]:
            t0, b = self._usage_before
            dt = at - t0
            out["output_tok_s"] = (u["output_tokens"] - b["output_tokens"]) / dt
            out["prefill_tok_s"] = ((u["prompt_tokens"] - u["cached_tokens"])
                                    - (b["prompt_tokens"] - b["cached_tokens"])) / dt
        return out

    def _role(self, cell: str, before: str, after: str, at: float) -> None:
        prev = self._role_at.get(cell)
        start_role, start = prev if prev is not None else (before, 0.0)
        self.role_spans.append({"cell_id": cell, "role": start_role, "start_s": start, "end_s": at})
        self._role_at[cell] = (after, at)

    def roles(self, now_s: float, cells: Any = ()) -> list[dict[str, Any]]:
        """Role intervals up to ``now_s`` (seconds since t0); cells that never switched (the core)
        are taken from ``cells`` (ListCells infos) for the whole span."""
        spans = list(self.role_spans)
        for cell, (role, start) in self._role_at.items():
            spans.append({"cell_id": cell, "role": role, "start_s": start, "end_s": now_s})
        seen = {s["cell_id"] for s in spans}
        for info in cells:
            c = info.cell
            if c.cell_id not in seen:
                role = getattr(c.role, "value", str(c.role))
                spans.append({"cell_id": c.cell_id, "role": role, "start_s": 0.0, "end_s": now_s})
        return spans

    def to_json_event(self, ev: Any) -> dict[str, Any]:
        return {"event_id": ev.event_id, "kind": ev.kind, "ts_s": ev.ts_s, "job_id": ev.job_id, **dict(ev.attrs)}


def follow(scheduler: Any, view: JobView, *, stop: Callable[[], bool] = lambda: False,
           poll_s: float = 5.0) -> Iterator[Any]:
    """Every event of the job until it ended (or ``stop()``), resuming after stream breaks (a
    scheduler restart, a timeout): yields each event after folding it into ``view``."""
    from services.common.errors import DeadlineExceeded, GyreError

    while not stop():
        try:
            for ev in scheduler.watch(view.job_id, after_event_id=view.last_event_id, follow=True, timeout_s=poll_s):
                view.add(ev)
                yield ev
                if stop():
                    return
        except DeadlineExceeded:  # deliberate: the stream is re-opened every poll_s (stop() is checked)
            pass
        except GyreError:  # deliberate: the scheduler restarts or is briefly unreachable: resume
            time.sleep(0.5)
        if view.ended:
            return
        try:
            job = scheduler.get_job(view.job_id)
        except GyreError:
            time.sleep(0.5)
            continue
        state = getattr(job.state, "value", str(job.state))
        if state in TERMINAL:
            # the stream may have ended right before the last events: read the rest once more
            for ev in scheduler.watch(view.job_id, after_event_id=view.last_event_id, follow=False, timeout_s=poll_s):
                view.add(ev)
                yield ev
            view.state = state
            view.weight_version = max(view.weight_version, int(job.weight_version))
            return


def step_rows(view: JobView, *, trainer: Any = None, trajectory: Any = None) -> list[dict[str, Any]]:
    """One row per published step: time, role switches during it (count, cell-seconds), naive vs
    tree tokens, the training executions' pass rate (reward >= 1, sampled), mean reward, timeouts
    and their partial rewards, each execution's calls and tokens (trajectory), trainer metrics."""
    rows = []
    before = 0.0
    for step in sorted(view.steps):
        row: dict[str, Any] = {"step": step, "time_s": view.steps[step]}
        # role switches during the step (from the previous publication to this one): their number
        # and the cell-seconds spent switching, clipped to the step
        end = view.steps[step]
        row["switches"] = sum(1 for w in view.switches if before < w["at_s"] <= end)
        row["switch_cell_s"] = sum(max(0.0, min(w["at_s"], end) - max(w["at_s"] - w["duration_s"], before))
                                   for w in view.switches)
        before = end
        if trajectory is not None:
            naive = tree = 0
            rewards: list[float] = []
            timeout_rewards: list[float] = []
            calls: list[int] = []
            tokens: list[int] = []
            for eid in view.exec_by_step.get(step, []):
                try:
                    st = trajectory.execution_stats(eid, job_id=view.job_id)
                except Exception:  # deliberate: an execution without records (failed early) has no stats
                    continue
                naive += st.naive_tokens
                tree += st.tree_tokens
                calls.append(st.num_calls)
                tokens.append(st.unique_tokens)
                if st.reward is not None:
                    rewards.append(st.reward)
                    if st.status == "timeout":
                        timeout_rewards.append(st.reward)
            row.update(naive_tokens=naive, tree_tokens=tree, execution_calls=calls, execution_tokens=tokens,
                       timeouts=len(timeout_rewards))
            if rewards:
                row.update(train_pass_rate=sum(r >= 1.0 - 1e-9 for r in rewards) / len(rewards),
                           train_reward=sum(rewards) / len(rewards))
            if timeout_rewards:
                row["timeout_reward"] = sum(timeout_rewards) / len(timeout_rewards)
        if trainer is not None:
            try:
                report = trainer.wait_step(step, timeout_s=1.0)
                row.update({k: float(v) for k, v in report.metrics.items()})
                if "tokens" in report.metrics:  # every micro-batch token the trainer's forwards processed
                    row["processed_tokens"] = float(report.metrics["tokens"])
            except Exception:  # deliberate: the trainer may run another job by now; metrics are optional
                pass
        rows.append(row)
    return rows


def write_job_report(view: JobView, out_dir: str | Path, *, scheduler: Any, trainer: Any = None,
                     trajectory: Any = None, meta: dict[str, Any] | None = None) -> Path:
    """report.html + figures + metrics.jsonl of a job, from its events (and the trainer's and
    trajectory's figures where those services are reachable)."""
    from services.report import write_report

    try:
        job = scheduler.get_job(view.job_id)
        spec = job.spec
        cells = scheduler.list_cells()
        now = (job.updated_s if view.ended else time.time()) - view.t0
        info = {"job": view.job_id, "state": view.state, "mode": spec.mode.value, "model": spec.model,
                "seed": spec.seed, "task source": spec.tasks.generator or "payloads",
                "weight version": job.weight_version, "outcomes": json.dumps(view.outcomes),
                "spec": spec.to_json()}
        u = view.usage()
        if u is not None:
            info["model calls"] = usage_line(u)
    except Exception:  # deliberate: a report of what the events say, even without the job record
        cells, now, info = [], 0.0, {"job": view.job_id, "state": view.state}
    rows = step_rows(view, trainer=trainer, trajectory=trajectory)
    return write_report(out_dir, steps=rows, evals=view.evals, roles=view.roles(now, cells), switches=view.switches,
                        meta={**info, **(meta or {})})
