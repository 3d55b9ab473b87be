"""Discrete-event simulator of a Gyre cluster, driven by the same ``policy.decide`` as production.

    trace (executions, turns) --> run queue --admission (staleness bound, placement)--> ROLLOUT cells
        ROLLOUT cell: processor-sharing model calls (speed(n)), tool time holds the KV slot
        execution done --> its group complete --> tokens join the step's training backlog
    TRAIN cells (core + joined replicas) drain the backlog of the update in progress (fluid)
        backlog drained and the step complete --> publish (publish_s) --> weight_version + 1
    after every state change: decide(view) --> role switches (with KV migrations)

Lifecycle of an execution: QUEUED -> (MODEL <-> ENV)* -> DONE, with TRANSIT while its KV moves
to another cell (a model call resumes where it stopped; tool time keeps running). It ends after
its last turn's tool time, or at the first turn boundary past its ``timeout_s``.
Lifecycle of a cell: IDLE -> SWITCHING -> ROLLOUT | TRAIN -> SWITCHING -> ... ; the core cell is
TRAIN from t=0 and never switches. Model calls on a cell advance a per-cell virtual clock at
``speed(active calls)``, so a change in load costs one heap push, not a pass over the calls.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.costs import SwitchCosts
from services.scheduler.sim.cost_model import CostModel
from services.common.roles import CellRole
from services.scheduler.policy import (
    Action, CellView, ClusterView, Mode, PolicyParams, check_actions, choose_cell, decide,
    effective_staleness_bound,
)
from services.task.traces import TraceExecution

QUEUED, MODEL, ENV, TRANSIT, DONE = range(5)
EV_CELL, EV_ENV, EV_ARRIVE, EV_SWITCH, EV_TRAIN, EV_PUBLISH, EV_WAKE = range(7)
EPS = 1e-9
TOKEN_EPS = 1e-3  # training backlog below this many tokens is empty (float rounding)


@dataclass
class SimResult:
    """What one simulated run measured."""

    mode: str
    makespan_s: float
    utilization: float  # busy cell-seconds / (cells x makespan); rollout busy = KV slot occupancy
    idle_cell_s: float  # cell-seconds with no work at all (empty rollout, train without data, IDLE)
    switching_cell_s: float
    switches: int  # role switches between ROLLOUT and TRAIN (first assignments not counted)
    mean_switch_s: float
    migrations: int
    mean_staleness: float
    max_staleness: int
    executions: int
    timeouts: int
    decisions: int
    events: int
    step_done_s: list[float] = field(default_factory=list)
    # Per step, (last finish - time 90% had finished) / (last finish - first start), averaged:
    # the share of a step's rollout span spent waiting on its last 10% of executions.
    rollout_tail_share: float = 0.0
    rollout_cells: int | None = None  # async: the static split

    def summary(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("step_done_s", "mode")}
        if self.rollout_cells is None:
            out.pop("rollout_cells")
        return out


class _Exec:
    __slots__ = ("idx", "step", "group", "work", "env", "cum_tokens", "timeout", "turn", "phase", "cell",
                 "start_t", "vfinish", "remaining", "transit_until", "env_end", "token", "staleness",
                 "end_t")

    def __init__(self, idx: int, e: TraceExecution, group: int, cost: CostModel) -> None:
        self.idx, self.step, self.group = idx, e.step, group
        self.work = e.model_work_s(cost).tolist()
        self.env = e.env_s.tolist()
        self.cum_tokens = np.cumsum(e.prompt_tokens + e.gen_tokens).tolist()
        self.timeout = e.timeout_s
        self.turn, self.phase, self.cell = 0, QUEUED, -1
        self.start_t = self.vfinish = self.remaining = self.transit_until = self.env_end = 0.0
        self.token = 0  # invalidates stale ENV/ARRIVE events after a migration
        self.staleness = 0
        self.end_t = 0.0


class _Cell:
    __slots__ = ("idx", "cell_id", "is_core", "role", "switching_to", "switch_end", "switch_start", "hosted",
                 "active", "n_active", "vclock", "last_t", "pause_until", "epoch", "from_idle")

    def __init__(self, idx: int, is_core: bool) -> None:
        self.idx, self.cell_id, self.is_core = idx, f"cell-{idx:03d}", is_core
        self.role = CellRole.TRAIN if is_core else CellRole.IDLE
        self.switching_to: CellRole | None = None
        self.switch_end = self.switch_start = 0.0
        self.hosted: set[int] = set()
        self.active: list[tuple[float, int]] = []  # (virtual finish, exec idx); lazily pruned
        self.n_active = 0
        self.vclock = self.last_t = self.pause_until = 0.0
        self.epoch = 0
        self.from_idle = False


class Simulator:
    """One run of one mode over one trace. ``run()`` once; the object is spent afterwards."""

    def __init__(self, trace: Sequence[TraceExecution], cost: CostModel, params: PolicyParams,
                 *, max_events: int = 50_000_000, oracle_longest_first: bool = False) -> None:
        """``oracle_longest_first``: admit each step's executions longest-first (solo latency). A
        diagnostic only: no real scheduler knows how long an execution will run."""
        self.cost, self.params, self.max_events = cost, params, max_events
        self.bound = effective_staleness_bound(params)
        self.slots = cost.slots
        self.speed = [cost.speed(n) for n in range(self.slots + 1)]  # hot path: a table, not a call
        # what elastic's policy weighs (services/scheduler/costs.py): the cost model's own numbers
        self.train_rates = tuple(cost.train_rate(k) for k in range(1, cost.num_cells + 1))
        groups: dict[str, int] = {}
        self.execs = [_Exec(i, e, groups.setdefault(e.group, len(groups)), cost) for i, e in enumerate(trace)]
        self.n_steps = max(e.step for e in self.execs) + 1
        self.queue: list[deque[int]] = [deque() for _ in range(self.n_steps)]
        order: list[int] = list(range(len(self.execs)))
        if oracle_longest_first:
            order = sorted(order, key=lambda i: -trace[i].solo_latency_s(cost))
        for i in order:
            self.queue[self.execs[i].step].append(i)
        self.step_size = [len(q) for q in self.queue]
        self.step_finished = [0] * self.n_steps
        self.group_left = [0] * len(groups)
        self.group_tokens = [0] * len(groups)
        for e in self.execs:
            self.group_left[e.group] += 1
        self.cells = [_Cell(i, i == 0) for i in range(cost.num_cells)]
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.version = 0
        self.first_open = 0  # lowest step with unstarted executions
        self.first_unfinished = 0  # lowest step with unfinished executions
        self.running = 0
        # Training of the update in progress (step == self.version).
        self.avail = [0.0] * (self.n_steps + 1)  # tokens of completed groups per step
        self.trained = 0.0
        self.train_last_t = 0.0
        self.train_epoch = 0
        self.publishing = False
        self.done = False
        # Accounting.
        self.acc_t = 0.0
        self.busy_cs = self.idle_cs = self.switching_cs = 0.0
        self.switches = self.migrations = self.decisions = self.events = self.timeouts = 0
        self.switch_time_total = 0.0
        self.step_done_s: list[float] = []
        self.calls_done = 0  # model calls completed; each exactly once (nothing recomputed or lost)
        # (time, cell_id, from role, to role, executions migrated away) for every switch started.
        self.switch_log: list[tuple[float, str, CellRole, CellRole, int]] = []

    # -- event plumbing -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def run(self) -> SimResult:
        self._state_changed()
        while self.heap and not self.done:
            t, _, kind, a, b = heapq.heappop(self.heap)
            self.events += 1
            if self.events > self.max_events:
                raise RuntimeError(f"simulation exceeded {self.max_events} events at t={t:.0f}s")
            self.now = t
            if kind == EV_CELL:
                if self.cells[a].epoch == b:
                    self._on_cell(self.cells[a])
            elif kind == EV_ENV:
                if self.execs[a].token == b:
                    self._on_env_done(self.execs[a])
            elif kind == EV_ARRIVE:
                if self.execs[a].token == b:
                    self._on_arrive(self.execs[a])
            elif kind == EV_SWITCH:
                self._on_switch_done(self.cells[a])
            elif kind == EV_TRAIN:
                if self.train_epoch == a:  # nothing changed since it was planned: the backlog is drained
                    self._account()
                    self._advance_training()
                    self.trained = self.avail[self.version]
                    self._state_changed()
            elif kind == EV_PUBLISH:
                self._on_publish_done()
            elif kind == EV_WAKE:
                self._reschedule(self.cells[a])
        if not self.done:
            raise RuntimeError(f"simulation stalled at t={self.now:.0f}s: update {self.version} of {self.n_steps} "
                               f"not published ({self.running} running, roles "
                               f"{[c.role.value for c in self.cells]})")
        return self._result()

    # -- rollout cells --------------------------------------------------------------------------
    def _advance_cell(self, c: _Cell) -> None:
        start = c.last_t if c.last_t > c.pause_until else c.pause_until
        if c.n_active and self.now > start:
            c.vclock += (self.now - start) * self.speed[c.n_active]
        c.last_t = self.now

    def _reschedule(self, c: _Cell) -> None:
        self._advance_cell(c)
        c.epoch += 1
        while c.active and self.execs[c.active[0][1]].phase != MODEL:  # drop migrated calls
            heapq.heappop(c.active)
        if c.n_active and c.active:
            start = self.now if self.now > c.pause_until else c.pause_until
            dt = c.active[0][0] - c.vclock
            self._push(start + (dt if dt > 0 else 0.0) / self.speed[c.n_active], EV_CELL, c.idx, c.epoch)

    def _begin_call(self, e: _Exec, c: _Cell, work: float) -> None:
        self._advance_cell(c)
        e.phase = MODEL
        e.vfinish = c.vclock + work
        heapq.heappush(c.active, (e.vfinish, e.idx))
        c.n_active += 1
        self._reschedule(c)

    def _on_cell(self, c: _Cell) -> None:
        self._advance_cell(c)
        # One call at a time: ending a call may finish an execution, which may move work around.
        while c.role is CellRole.ROLLOUT and c.active:
            vf, idx = c.active[0]
            e = self.execs[idx]
            if e.phase != MODEL or e.cell != c.idx or e.vfinish != vf:
                heapq.heappop(c.active)
                continue
            if vf > c.vclock + EPS * max(1.0, abs(c.vclock)):
                break
            heapq.heappop(c.active)
            c.n_active -= 1
            self.calls_done += 1
            e.phase = ENV
            self._end_call(e)
        self._reschedule(c)

    def _end_call(self, e: _Exec) -> None:
        if self._timed_out(e, done_turns=e.turn + 1):
            return
        e.env_end = self.now + e.env[e.turn]
        self._push(max(e.env_end, e.transit_until), EV_ENV, e.idx, e.token)

    def _on_env_done(self, e: _Exec) -> None:
        if self.now < e.transit_until - EPS:  # its KV is still moving: resume when it lands
            self._push(e.transit_until, EV_ENV, e.idx, e.token)
            return
        if e.turn == len(e.work) - 1:
            self._finish(e, done_turns=len(e.work), timed_out=False)
            return
        e.turn += 1
        if self._timed_out(e, done_turns=e.turn):
            return
        self._begin_call(e, self.cells[e.cell], e.work[e.turn])

    def _timed_out(self, e: _Exec, done_turns: int) -> bool:
        if e.timeout is not None and self.now - e.start_t >= e.timeout:
            self._finish(e, done_turns=done_turns, timed_out=True)
            return True
        return False

    def _on_arrive(self, e: _Exec) -> None:
        e.transit_until = 0.0
        self._begin_call(e, self.cells[e.cell], e.remaining)

    def _start(self, e: _Exec, c: _Cell) -> None:
        e.cell, e.start_t, e.turn = c.idx, self.now, 0
        e.staleness = e.step - self.version
        assert 0 <= e.staleness <= self.bound, "admission broke the staleness bound"
        c.hosted.add(e.idx)
        self.running += 1
        self._begin_call(e, c, e.work[0])

    def _finish(self, e: _Exec, *, done_turns: int, timed_out: bool) -> None:
        """End an execution between model calls (never mid-call); its tokens so far are trainable."""
        self._account()
        c = self.cells[e.cell]
        assert e.phase == ENV
        e.phase = DONE
        e.end_t = self.now
        c.hosted.discard(e.idx)
        self.running -= 1
        self.timeouts += timed_out
        self.step_finished[e.step] += 1
        self.group_tokens[e.group] += int(e.cum_tokens[done_turns - 1]) if done_turns else 0
        self.group_left[e.group] -= 1
        if self.group_left[e.group] == 0:  # the group's advantages can be computed: train on it
            self._advance_training()
            self.avail[e.step] += self.group_tokens[e.group]
        self._state_changed()

    # -- admission ------------------------------------------------------------------------------
    def _last_startable(self) -> int:
        """The highest step whose rollouts may start now (see ``policy.may_start``)."""
        last = min(self.n_steps - 1, self.version + self.bound)
        if self.params.rollout_batches:
            while self.first_unfinished < self.n_steps and \
                    self.step_finished[self.first_unfinished] == self.step_size[self.first_unfinished]:
                self.first_unfinished += 1
            last = min(last, self.first_unfinished)
        return last

    def _admit(self) -> None:
        last = self._last_startable()
        mode = self.params.mode
        while self.first_open <= last:
            q = self.queue[self.first_open]
            if not q:
                self.first_open += 1
                continue
            cands = [(c, len(c.hosted)) for c in self.cells if c.role is CellRole.ROLLOUT and len(c.hosted) < self.slots]
            cell = choose_cell(cands, mode)
            if cell is None:
                return
            self._start(self.execs[q.popleft()], cell)

    def _queued(self) -> int:
        last = self._last_startable()
        return sum(len(self.queue[s]) for s in range(self.first_open, last + 1))

    # -- training -------------------------------------------------------------------------------
    def _train_cells(self) -> int:
        return sum(1 for c in self.cells if c.role is CellRole.TRAIN)

    def _advance_training(self) -> None:
        if not self.publishing and self.version < self.n_steps:
            rate = self.cost.train_rate(self._train_cells())
            self.trained = min(self.avail[self.version], self.trained + rate * (self.now - self.train_last_t))
        self.train_last_t = self.now

    def _schedule_training(self) -> None:
        self.train_epoch += 1
        if self.publishing or self.version >= self.n_steps:
            return
        s = self.version
        backlog = self.avail[s] - self.trained
        if backlog <= TOKEN_EPS and self.step_finished[s] == self.step_size[s]:
            self._account()
            self.publishing = True
            self._push(self.now + self.cost.publish_s, EV_PUBLISH)
            return
        rate = self.cost.train_rate(self._train_cells())
        if backlog > TOKEN_EPS and rate > 0:
            self._push(self.now + backlog / rate, EV_TRAIN, self.train_epoch)

    def _on_publish_done(self) -> None:
        self._account()
        self.publishing = False
        self.version += 1
        self.trained = 0.0
        self.train_last_t = self.now
        self.step_done_s.append(self.now)
        if self.version >= self.n_steps:
            self.done = True
            return
        for c in self.cells:  # engines load the new weights; their calls pause meanwhile
            if c.role is CellRole.ROLLOUT and self.cost.weight_sync_s > 0:
                self._advance_cell(c)
                c.pause_until = self.now + self.cost.weight_sync_s
                self._push(c.pause_until, EV_WAKE, c.idx)
                self._reschedule(c)
        self._state_changed()

    # -- policy ---------------------------------------------------------------------------------
    def _state_changed(self) -> None:
        """Admit, ask the policy, apply its switches, then re-plan training."""
        self._account()
        self._advance_training()
        self._admit()
        actions = decide(self._view(), self.params)
        self.decisions += 1
        if actions:
            self._apply(actions)
            self._admit()
        self._schedule_training()

    def _view(self) -> ClusterView:
        kv = self.cost.execution_kv_tokens
        cells = tuple(CellView(cell_id=c.cell_id, role=c.role, is_core=c.is_core, inflight=len(c.hosted),
                               kv_used_tokens=len(c.hosted) * kv, kv_capacity_tokens=self.cost.kv_capacity_tokens,
                               switching_to=c.switching_to) for c in self.cells)
        s = min(self.version, self.n_steps - 1)
        backlog = self.avail[s] - self.trained
        return ClusterView(now_s=self.now, step=s, weight_version=self.version, cells=cells, queued=self._queued(),
                           running=self.running, finished_in_step=self.step_finished[s],
                           step_size=self.step_size[s], train_ready=backlog > TOKEN_EPS and not self.publishing,
                           training_active=self.publishing or self.avail[s] > 0,
                           next_step_allowed=s + 1 <= self._last_startable(),
                           costs=SwitchCosts(rollout_to_train_s=self.cost.rollout_to_train_s,
                                             train_to_rollout_s=self.cost.train_to_rollout_s,
                                             train_tok_s=self.train_rates, train_left_tokens=max(0.0, backlog),
                                             basis="cost model"))

    def _apply(self, actions: list[Action]) -> None:
        check_actions(self._view(), actions, float(self.cost.execution_kv_tokens))
        self._advance_training()
        by_id = {c.cell_id: c for c in self.cells}
        for a in actions:
            c = by_id[a.cell_id]
            transfer = 0.0
            hosted_before = len(c.hosted)
            if c.role is CellRole.ROLLOUT and c.hosted:
                transfer = self._migrate(c, [by_id[t] for t in a.migrate_to])
            if c.role is CellRole.IDLE:
                cost = self.cost.idle_to_rollout_s if a.to_role is CellRole.ROLLOUT else self.cost.idle_to_train_s
                c.from_idle = True
            else:
                cost = self.cost.rollout_to_train_s if a.to_role is CellRole.TRAIN else self.cost.train_to_rollout_s
                c.from_idle = False
            self._advance_cell(c)
            self.switch_log.append((self.now, c.cell_id, c.role, a.to_role, hosted_before))
            c.role, c.switching_to = CellRole.SWITCHING, a.to_role
            c.switch_start, c.switch_end = self.now, self.now + transfer + cost
            c.active.clear()
            c.n_active = 0
            c.epoch += 1
            self._push(c.switch_end, EV_SWITCH, c.idx)

    def _migrate(self, src: _Cell, targets: list[_Cell]) -> float:
        """Move every execution hosted on ``src`` to ``targets`` (in order); returns the longest transfer."""
        self._advance_cell(src)
        longest = 0.0
        moving = sorted(src.hosted)
        for dst in targets:
            room = self.slots - len(dst.hosted)
            while room > 0 and moving:
                e = self.execs[moving.pop(0)]
                transfer = self.cost.migration_s(int(e.cum_tokens[e.turn]))
                longest = max(longest, transfer)
                src.hosted.discard(e.idx)
                dst.hosted.add(e.idx)
                e.cell = dst.idx
                e.token += 1
                self.migrations += 1
                if e.phase == MODEL:
                    e.remaining = max(0.0, e.vfinish - src.vclock)
                    e.phase = TRANSIT
                    e.transit_until = self.now + transfer
                    self._push(e.transit_until, EV_ARRIVE, e.idx, e.token)
                elif e.phase == TRANSIT:  # moved again before landing: land later, elsewhere
                    e.transit_until = max(e.transit_until, self.now) + transfer
                    self._push(e.transit_until, EV_ARRIVE, e.idx, e.token)
                else:  # tool time keeps running; the next call waits for the KV
                    e.transit_until = self.now + transfer
                    self._push(max(e.env_end, e.transit_until), EV_ENV, e.idx, e.token)
                room -= 1
        assert not moving, "policy sent a cell to switch without room for its executions"
        return longest

    def _on_switch_done(self, c: _Cell) -> None:
        self._account()
        self._advance_training()
        to = c.switching_to
        assert to is not None
        c.role, c.switching_to = to, None
        c.last_t = self.now
        c.pause_until = 0.0
        if not c.from_idle:
            self.switches += 1
            self.switch_time_total += self.now - c.switch_start
        self._state_changed()

    # -- accounting -----------------------------------------------------------------------------
    def _account(self) -> None:
        dt = self.now - self.acc_t
        if dt <= 0:
            return
        self.acc_t = self.now
        training = self.publishing or (self.version < self.n_steps and self.avail[self.version] - self.trained > TOKEN_EPS)
        for c in self.cells:
            if c.role is CellRole.ROLLOUT:
                n = len(c.hosted)
                self.busy_cs += dt * n / self.slots
                if n == 0:
                    self.idle_cs += dt
            elif c.role is CellRole.TRAIN:
                if training and (not self.publishing or c.is_core):
                    self.busy_cs += dt
                else:
                    self.idle_cs += dt
            elif c.role is CellRole.SWITCHING:
                self.switching_cs += dt
            else:
                self.idle_cs += dt

    def _result(self) -> SimResult:
        self._account()
        total = self.cost.num_cells * self.now
        stale = [e.staleness for e in self.execs]
        shares = []
        for s in range(self.n_steps):
            ends = np.sort([e.end_t for e in self.execs if e.step == s])
            first = min(e.start_t for e in self.execs if e.step == s)
            t90 = ends[max(0, math.ceil(0.9 * len(ends)) - 1)]
            shares.append((ends[-1] - t90) / (ends[-1] - first) if ends[-1] > first else 0.0)
        return SimResult(mode=self.params.mode.value, makespan_s=self.now, utilization=self.busy_cs / total,
                         idle_cell_s=self.idle_cs, switching_cell_s=self.switching_cs, switches=self.switches,
                         mean_switch_s=self.switch_time_total / self.switches if self.switches else 0.0,
                         migrations=self.migrations, mean_staleness=float(np.mean(stale)),
                         max_staleness=int(max(stale)), executions=len(self.execs), timeouts=self.timeouts,
                         decisions=self.decisions, events=self.events, step_done_s=list(self.step_done_s),
                         rollout_tail_share=float(np.mean(shares)),
                         rollout_cells=self.params.async_rollout_cells if self.params.mode is Mode.ASYNC else None)


def simulate(trace: Sequence[TraceExecution], cost: CostModel, params: PolicyParams, *,
             oracle_longest_first: bool = False) -> SimResult:
    """Run ``trace`` on the cluster ``cost`` under ``params``; every execution runs to its end."""
    if params.mode is Mode.ASYNC and params.async_rollout_cells is not None \
            and params.async_rollout_cells > cost.num_cells - 1:
        raise ValueError(f"async_rollout_cells={params.async_rollout_cells} leaves no room for the core cell "
                         f"(num_cells={cost.num_cells})")
    return Simulator(trace, cost, params, oracle_longest_first=oracle_longest_first).run()
