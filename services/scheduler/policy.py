"""The scheduling policy: one pure function decides cell roles for all three modes.

``decide(view, params)`` looks at an immutable snapshot of the cluster (``ClusterView``) and
returns role switches (``Action``). It does no I/O: the live scheduler builds the view from Redis
and drives the switches through the rollout gateway and trainer; the simulator
(``simulator.py``) builds the view from its event model. Both call this same function.

Modes (``Mode``):

* ``colocate``: every non-core cell alternates. The pool rolls out a step; when no rollout is
  running or startable and the step's training data is ready, the pool switches to TRAIN; when
  the update is published and the next step's rollouts may start, it switches back. The core
  trains streamed micro-batches meanwhile. Colocate is on-policy by construction (a rollout that
  overlapped an update would have to be interrupted when the whole pool switches), so its
  effective staleness bound is 0.
* ``async``: a static split, ``async_rollout_cells`` non-core cells in ROLLOUT and the rest
  (plus the core) in TRAIN, with rollouts of later steps running within the staleness bound.
* ``elastic``: starts every non-core cell in ROLLOUT. Rollout capacity follows rollout demand
  (running + startable executions, packed ``slots`` to a cell): when demand falls, the emptiest
  rollout cells hand their in-flight executions to cells with KV room (migration, no
  recomputation) and switch to TRAIN to join the running update; when startable work exceeds
  the rollout capacity (typically when an update is published and the next step opens), TRAIN
  cells return to ROLLOUT. Rollouts of later steps may overlap the running update within the
  staleness bound, exactly as in async. Given the cluster's measured ``SwitchCosts``
  (``costs.py``), a cell is freed only when the update finishes sooner by more than the cell's
  way back to rollout, so on cells that share one host's compute elastic stops paying for
  switches that buy no training speed.

Invariants (asserted by ``check_actions`` and the tests): the core cell never switches; a
SWITCHING cell gets no action; a ROLLOUT cell switches away only when it hosts nothing or when
every hosted execution is migrated to ROLLOUT cells with KV room, so no execution is
interrupted. "Hosts nothing" is judged by the job's own counters first: a cell's ``inflight``
comes from its last heartbeat and lags, so when the job has no running execution, a cell that
still reports some hosts none of the job's (the actuator's drain checks the engine itself and
refuses to drop a request it really still holds). Admission (which execution may start, and where) is decided by ``may_start`` and
``place_execution`` so that the staleness bound is enforced in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal, TypeVar

from services.common.roles import CellRole
from services.scheduler.costs import SwitchCosts

K = TypeVar("K")


class Mode(str, Enum):
    """How the pool shares rollout and training."""

    COLOCATE = "colocate"
    ASYNC = "async"
    ELASTIC = "elastic"


@dataclass(frozen=True)
class CellView:
    """One cell as the policy sees it."""

    cell_id: str
    role: CellRole
    is_core: bool
    inflight: int  # executions (model-call contexts) currently hosted by this cell's engine
    kv_used_tokens: int
    kv_capacity_tokens: int
    switching_to: CellRole | None = None
    cordoned: bool = False  # an operator keeps it out of rollout (drained, then it trains)

    def __post_init__(self) -> None:
        if self.inflight < 0 or self.kv_used_tokens < 0 or self.kv_capacity_tokens < 0:
            raise ValueError(f"cell {self.cell_id!r}: inflight and KV token counts must be >= 0")
        if (self.role is CellRole.SWITCHING) != (self.switching_to is not None):
            raise ValueError(f"cell {self.cell_id!r}: switching_to is set exactly when role is SWITCHING")

    @property
    def kv_per_execution(self) -> float:
        """Average KV tokens one hosted execution holds here (0 when nothing is hosted)."""
        return self.kv_used_tokens / self.inflight if self.inflight else 0.0


@dataclass(frozen=True)
class ClusterView:
    """An immutable snapshot of the cluster and the job's progress."""

    now_s: float
    step: int  # the step whose update is in progress (or next to run)
    weight_version: int  # published updates so far
    cells: tuple[CellView, ...]
    queued: int  # executions of the current (and allowed future) steps not yet started
    running: int  # executions started and not finished
    finished_in_step: int
    step_size: int  # executions per step
    train_ready: bool  # the step's training batch is (partly) available, so TRAIN cells have work
    training_active: bool  # an update is in progress
    next_step_allowed: bool  # staleness bound lets rollouts of step+1 start now
    # What switches cost and buy (elastic weighs them); None: not measured yet, decide without.
    costs: SwitchCosts | None = None


@dataclass(frozen=True)
class PolicyParams:
    """Job-level knobs of the policy."""

    mode: Mode
    # Max weight versions between the policy a sample trains and the policy that generated it
    # (async and elastic; colocate is always 0).
    staleness_bound: int = 1
    # async: non-core cells held in ROLLOUT; required in async mode.
    async_rollout_cells: int | None = None
    # elastic: never shrink rollout below this many cells while anything runs or is startable.
    min_rollout_cells: int = 1
    # elastic: target KV occupancy of rollout cells when consolidating, in (0, 1]. 1.0 packs
    # executions tight (fewest rollout cells); lower values keep headroom and migrate less.
    consolidate_threshold: float = 1.0
    # elastic: KV tokens one execution reserves (the job's context window). None: inferred from
    # the cells (largest per-execution KV in use), or the whole cell when nothing runs.
    execution_kv_tokens: int | None = None
    # Admission: a step's rollouts start only once every rollout of the previous step has
    # finished (one-step-off async as common trainers ship it). False: any step within the
    # staleness bound may start (fully asynchronous refill; the default, and the stronger).
    rollout_batches: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode must be one of {[m.value for m in Mode]}, got {self.mode!r}")
        if self.staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")
        if self.mode is Mode.ASYNC and (self.async_rollout_cells is None or self.async_rollout_cells < 1):
            raise ValueError("async mode needs async_rollout_cells >= 1 (the static rollout split)")
        if self.min_rollout_cells < 0:
            raise ValueError(f"min_rollout_cells must be >= 0, got {self.min_rollout_cells}")
        if not 0.0 < self.consolidate_threshold <= 1.0:
            raise ValueError(f"consolidate_threshold must be in (0, 1], got {self.consolidate_threshold}")
        if self.execution_kv_tokens is not None and self.execution_kv_tokens < 1:
            raise ValueError(f"execution_kv_tokens must be >= 1, got {self.execution_kv_tokens}")


@dataclass(frozen=True)
class Action:
    """Switch ``cell_id`` to ``to_role``; for ROLLOUT->TRAIN, migrate its executions first."""

    kind: Literal["switch"]
    cell_id: str
    to_role: CellRole
    migrate_to: tuple[str, ...] = ()  # cells receiving its in-flight executions, in fill order
    reason: str = ""


def effective_staleness_bound(params: PolicyParams) -> int:
    """The bound admission enforces: colocate never overlaps rollouts with an update."""
    return 0 if params.mode is Mode.COLOCATE else params.staleness_bound


def may_start(execution_step: int, weight_version: int, params: PolicyParams,
              previous_step_finished: bool = True) -> bool:
    """Whether an execution of ``execution_step`` may start under ``weight_version``.

    Its tokens are ``execution_step - weight_version`` versions older than the policy that trains
    them (at worst: an engine may receive newer weights mid-execution).
    """
    if params.rollout_batches and not previous_step_finished:
        return False
    return execution_step - weight_version <= effective_staleness_bound(params)


def slots_per_cell(cell: CellView, execution_kv_tokens: float) -> int:
    """How many executions fit in a cell's KV (at least 1, so a cell can always host one)."""
    return max(1, int(cell.kv_capacity_tokens // max(execution_kv_tokens, 1.0)))


def free_slots(cell: CellView, execution_kv_tokens: float) -> int:
    """Executions a ROLLOUT cell can still admit (slots left, and KV left for a whole window)."""
    if cell.role is not CellRole.ROLLOUT:
        return 0
    kv = execution_kv_tokens if execution_kv_tokens > 1.0 else 1.0
    slots = cell.kv_capacity_tokens // kv
    by_slots = (slots if slots >= 1 else 1) - cell.inflight
    by_kv = (cell.kv_capacity_tokens - cell.kv_used_tokens) // kv
    free = by_slots if by_slots < by_kv else by_kv
    return int(free) if free > 0 else 0


def choose_cell(candidates: Iterable[tuple[K, int]], mode: Mode) -> K | None:
    """Pick among ``(key, inflight)`` of ROLLOUT cells with a free slot; first wins ties.

    Elastic packs (most loaded cell with room) so that emptier cells can be freed for training;
    colocate and async spread (least loaded), which gives the fastest decode per request.
    """
    best: K | None = None
    best_load = 0
    pack = mode is Mode.ELASTIC
    for key, load in candidates:
        if best is None or (load > best_load if pack else load < best_load):
            best, best_load = key, load
    return best


def place_execution(view: ClusterView, params: PolicyParams, execution_kv_tokens: float) -> str | None:
    """The ROLLOUT cell a new execution starts on, or None when no cell has room."""
    return choose_cell(((c.cell_id, c.inflight) for c in view.cells if free_slots(c, execution_kv_tokens) > 0),
                       params.mode)


def execution_kv_tokens(view: ClusterView, params: PolicyParams) -> float:
    """KV tokens one execution reserves: the job's value, else inferred from the cells."""
    if params.execution_kv_tokens is not None:
        return float(params.execution_kv_tokens)
    per_exec = [c.kv_per_execution for c in view.cells if c.inflight > 0]
    if per_exec:
        return max(per_exec)
    return float(max((c.kv_capacity_tokens for c in view.cells), default=1))


def decide(view: ClusterView, params: PolicyParams) -> list[Action]:
    """Role switches to make now (possibly none). Pure: same view and params, same answer.

    Cordoned cells are not the mode's to move: it decides over the others, and a cordoned cell in
    ROLLOUT is drained to TRAIN (its requests migrating to rollout cells with room; while they
    lack room it stays, and is tried again on the next tick)."""
    cordoned = [c for c in view.cells if c.cordoned]
    mode_view = dataclasses.replace(view, cells=tuple(c for c in view.cells if not c.cordoned)) if cordoned else view
    if params.mode is Mode.COLOCATE:
        actions = _decide_colocate(mode_view)
    elif params.mode is Mode.ASYNC:
        actions = _decide_async(mode_view, params)
    else:
        actions = _decide_elastic(mode_view, params)
    kv_exec = execution_kv_tokens(view, params)
    if cordoned:
        actions += _drain_cordoned(view, cordoned, actions, kv_exec)
    check_actions(view, actions, kv_exec)
    return actions


def _drain_cordoned(view: ClusterView, cordoned: list[CellView], actions: list[Action],
                    kv_exec: float) -> list[Action]:
    """TRAIN switches of cordoned ROLLOUT cells whose in-flight executions fit elsewhere."""
    busy = {a.cell_id for a in actions} | {t for a in actions for t in a.migrate_to}
    room = {c.cell_id: free_slots(c, kv_exec) for c in view.cells
            if c.role is CellRole.ROLLOUT and not c.cordoned and c.cell_id not in busy}
    out = []
    for cell in cordoned:
        if cell.role is not CellRole.ROLLOUT:
            continue
        need = cell.inflight if view.running > 0 else 0  # nothing of the job runs: nothing to move
        targets = []
        for target in sorted(room, key=lambda t: -room[t]):
            if need <= 0:
                break
            take = min(room[target], need)
            if take:
                targets.append(target)
                need -= take
        if need > 0:
            continue  # no room for its work now: the next tick tries again
        for target in targets:
            room.pop(target)  # a receiver takes one drained cell's work per pass
        out.append(_switch(cell, CellRole.TRAIN, "cordoned: drained of rollout work", migrate_to=tuple(targets)))
    return out


def _switch(cell: CellView, to: CellRole, reason: str, migrate_to: tuple[str, ...] = ()) -> Action:
    return Action(kind="switch", cell_id=cell.cell_id, to_role=to, migrate_to=migrate_to, reason=reason)


def _movable(view: ClusterView) -> list[CellView]:
    """Non-core cells that may receive an action (not mid-switch), in a stable order."""
    return sorted((c for c in view.cells if not c.is_core and c.role is not CellRole.SWITCHING),
                  key=lambda c: c.cell_id)


def _decide_colocate(view: ClusterView) -> list[Action]:
    cells = _movable(view)
    rollout_idle = view.running == 0 and view.queued == 0
    if rollout_idle and view.train_ready:
        # The whole step has rolled out: the whole pool joins the core on the update. Not only the
        # cells whose last heartbeat says "empty": that count lags by a heartbeat, and the job's own
        # counters say no execution runs, so nothing of the job is hosted anywhere (a request the
        # engine really still hosts makes the drain refuse, and the switch is retried).
        return [_switch(c, CellRole.TRAIN, "colocate: step rolled out") for c in cells
                if c.role in (CellRole.IDLE, CellRole.ROLLOUT)]
    if view.queued + view.running > 0:
        # Rollout work exists only once the previous update is published (bound 0), so the pool
        # goes back as soon as there is any, queued or already leased by harnesses (which then
        # wait for an engine), whatever `training_active` says: a trainer that opened the next step
        # waits for the batches only these cells can produce.
        return [_switch(c, CellRole.ROLLOUT, "colocate: update published") for c in cells
                if c.role in (CellRole.TRAIN, CellRole.IDLE)]
    return []


def _decide_async(view: ClusterView, params: PolicyParams) -> list[Action]:
    assert params.async_rollout_cells is not None
    non_core = [c for c in view.cells if not c.is_core]
    want = min(params.async_rollout_cells, len(non_core))
    have = sum(1 for c in non_core if c.role is CellRole.ROLLOUT or c.switching_to is CellRole.ROLLOUT)
    actions: list[Action] = []
    cells = _movable(view)
    # Grow rollout from IDLE first, then TRAIN; shrink it with empty rollout cells only.
    for c in sorted(cells, key=lambda c: (c.role is not CellRole.IDLE, c.cell_id)):
        if have < want and c.role in (CellRole.IDLE, CellRole.TRAIN):
            actions.append(_switch(c, CellRole.ROLLOUT, f"async: static split {want} rollout cells"))
            have += 1
        elif c.role is CellRole.IDLE:
            actions.append(_switch(c, CellRole.TRAIN, "async: static split"))
        elif have > want and c.role is CellRole.ROLLOUT and c.inflight == 0:
            actions.append(_switch(c, CellRole.TRAIN, f"async: static split {want} rollout cells"))
            have -= 1
    return actions


def _decide_elastic(view: ClusterView, params: PolicyParams) -> list[Action]:
    kv_exec = execution_kv_tokens(view, params)
    non_core = [c for c in view.cells if not c.is_core]
    if not non_core:
        return []
    slots = max(slots_per_cell(c, kv_exec) for c in non_core)
    demand = view.running + view.queued  # executions that need a slot now
    need = math.ceil(demand / (slots * params.consolidate_threshold)) if demand else 0
    if demand:
        need = max(need, params.min_rollout_cells)
    need = min(need, len(non_core))
    rollout = [c for c in non_core if c.role is CellRole.ROLLOUT]
    have = len(rollout) + sum(1 for c in non_core if c.switching_to is CellRole.ROLLOUT)
    train_work = view.train_ready or view.training_active
    actions: list[Action] = []

    for c in _movable(view):
        if c.role is not CellRole.IDLE:
            continue
        if have < need or not train_work:
            actions.append(_switch(c, CellRole.ROLLOUT, "elastic: assign"))
            have += 1
        else:
            actions.append(_switch(c, CellRole.TRAIN, "elastic: assign"))

    if have < need:
        # Startable rollouts outnumber free slots: bring TRAIN cells back (the update keeps the core).
        for c in _movable(view):
            if have >= need:
                break
            if c.role is CellRole.TRAIN:
                actions.append(_switch(c, CellRole.ROLLOUT, f"elastic: rollout demand {demand} needs {need} cells"))
                have += 1
    elif have > need and view.train_ready:
        training = sum(1 for c in view.cells if c.role is CellRole.TRAIN or c.switching_to is CellRole.TRAIN)
        actions.extend(_consolidate(rollout, have - need, kv_exec, demand, view.costs, training))
    return actions


def _consolidate(rollout: list[CellView], surplus: int, kv_exec: float, demand: int,
                 costs: SwitchCosts | None = None, training: int = 1) -> list[Action]:
    """Free up to ``surplus`` rollout cells for training, emptiest first, migrating their work.

    With ``costs``, a cell is freed only while the update (run by ``training`` TRAIN cells, one
    more per cell freed) gains more than that cell's way back to rollout; the gain shrinks as
    cells are added, so the first cell not worth it ends the pass.

    Cells sorted by load: the emptiest are freed from the bottom, their executions go to the
    fullest cells with room from the top (so the next cells to free stay empty). A cell is freed
    only when all it hosts fits; the next one hosts at least as much with fewer receivers, so
    the first misfit ends the pass. O(cells log cells).
    """
    order = sorted(rollout, key=lambda c: (c.inflight, c.cell_id))
    room = [free_slots(c, kv_exec) for c in order]
    actions: list[Action] = []
    top = len(order) - 1  # next receiver to fill (fullest with room first)
    received: set[int] = set()
    for lo, cell in enumerate(order):
        if len(actions) >= surplus or lo in received:
            break
        need, j, takes = cell.inflight, top, []  # tentative: commit only when everything fits
        while need > 0 and j > lo:
            take = min(room[j], need)
            if take > 0:
                takes.append((j, take))
                need -= take
            if take == room[j]:
                j -= 1
        if need > 0:
            break
        reason = f"elastic: consolidate, rollout demand {demand}"
        if costs is not None:
            world = training + len(actions)
            gain = costs.gain_s(world)
            if gain <= costs.train_to_rollout_s:
                break
            reason += (f"; the update ends ~{gain:.1f} s sooner with {world + 1} TRAIN cells, more than the "
                       f"{costs.train_to_rollout_s:.1f} s way back ({costs.basis})")
        for k, take in takes:
            room[k] -= take
            received.add(k)
        top = j
        targets = [order[k].cell_id for k, _ in takes]
        actions.append(_switch(cell, CellRole.TRAIN, reason, migrate_to=tuple(targets)))
    return actions


def check_actions(view: ClusterView, actions: list[Action], kv_exec: float) -> None:
    """Assert the policy invariants on a batch of actions against the view it came from."""
    by_id = {c.cell_id: c for c in view.cells}
    seen: set[str] = set()
    room: dict[str, int] = {}  # free slots of migration targets, computed on first use
    for a in actions:
        cell = by_id.get(a.cell_id)
        assert cell is not None, f"action for unknown cell {a.cell_id}"
        assert a.cell_id not in seen, f"two actions for cell {a.cell_id}"
        seen.add(a.cell_id)
        assert not cell.is_core, f"core cell {a.cell_id} must never switch"
        assert cell.role is not CellRole.SWITCHING, f"cell {a.cell_id} is mid-switch"
        assert a.to_role in (CellRole.ROLLOUT, CellRole.TRAIN) and a.to_role is not cell.role, a
        if cell.role is CellRole.ROLLOUT and cell.inflight > 0 and view.running > 0:
            need = cell.inflight
            for target in a.migrate_to:
                assert target != a.cell_id and target not in seen, f"bad migration target {target}"
                t = by_id[target]
                assert t.role is CellRole.ROLLOUT, f"migration target {target} is not a rollout cell"
                if target not in room:
                    room[target] = free_slots(t, kv_exec)
                take = min(room[target], need)
                room[target] -= take
                need -= take
            assert need == 0, f"cell {a.cell_id} would interrupt {need} executions"
    for a in actions:  # a cell that is being freed cannot also receive executions
        for target in a.migrate_to:
            assert target not in seen, f"migration target {target} is itself switching"
