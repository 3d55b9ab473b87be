"""The built-in XLong task family: "build a small repo" of GyreStack modules, generated from a seed.

A task is a spec of `num_modules` modules ``m1..mN``. Each module is one integer function given as
a chain of steps applied to the value so far: a start (``x`` or a call ``m1 ( x )``), then ``add c``,
``mul c``, ``sub c`` (value - c) or ``rsub c`` (c - value); ``m1 ( x ) , mul 2 , rsub 7`` is
``7 - m1(x) * 2``. The agent writes the module as postfix GyreStack code, one line per step
(``x m1`` / ``2 *`` / ``7 swap -``). Later modules may call earlier ones, so a wrong module can
fail the tests of the modules built on it, as in a real repository. Each module has visible tests
(shown to the agent and run by the harness) and hidden tests (only the reward scorer runs them).

Tasks are pure functions of their id: ``xlong-v1/<split>/<seed>/<knobs>``. The reward scorer rebuilds
the tests from the id, so a workspace can never change what it is graded against. Splits draw from
separate random streams; `heldout` tasks are the evaluation set.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from services.task.dsl import run_program

__all__ = ["TaskParams", "ModuleSpec", "TaskSpec", "generate_task", "task_from_id", "task_ids", "task_generator",
           "heldout_tasks", "tool_task_generator", "tool_heldout_tasks", "SPLITS", "FAMILIES"]

SPLITS = ("train", "heldout")
FAMILIES = ("xlong-v1", "xlong-tools-v1")  # the word-level agent's and the tool agent's: the same tasks
_ID_RE = re.compile(r"^(xlong-v1|xlong-tools-v1)/(train|heldout)/(\d{1,12})/m(\d+)\.s(\d+)-(\d+)\.c(\d+)\.t(\d+)\.h(\d+)"
                    r"(?:\.l(\d+)x(\d+))?$")
_MAX_ABS_OUTPUT = 999  # keeps test values a few digit tokens long
_INPUTS = tuple(range(0, 10))
# Step words and their postfix lines: the value so far is on the stack, the constant goes on top.
# `rsub` is the one whose line needs a swap: `value c swap -` = c - value.
STEP_CODE = {"add": "{c} +", "sub": "{c} -", "rsub": "{c} swap -", "mul": "{c} *"}
_STEP_WORDS = ("add", "mul", "rsub", "sub")
# `sub` is the step the warm-start demonstrator gets wrong (services.task.demos); its share sets
# how far below the ceiling the warm-started policy starts.
_STEP_WEIGHTS = (30, 30, 25, 15)


@dataclass(frozen=True, kw_only=True)
class TaskParams:
    """Difficulty knobs of the task family; the harness's knobs (context, turns) live in AgentConfig."""

    num_modules: int = 4
    """Modules in the repo: the main horizon knob (each costs at least one model call and test run)."""
    min_ops: int = 1
    """Fewest operations in one module's expression."""
    max_ops: int = 3
    """Most operations in one module's expression (longer code, more places to go wrong)."""
    call_pct: int = 30
    """Percent chance that a module (after the first) starts from a call to an earlier module."""
    visible_tests: int = 2
    """Tests per module the agent sees and the harness runs."""
    hidden_tests: int = 2
    """Extra tests per module that only the reward scorer runs."""
    long_pct: int = 0
    """Percent of tasks that are long (``long_modules`` modules instead of ``num_modules``): the heavy
    tail of real agent executions, the ones a job's deadline cuts (scored partially). Which tasks
    are long depends on the seed and split only."""
    long_modules: int = 0
    """Modules of a long task (more than ``num_modules``); ignored (0) when ``long_pct`` is 0."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_modules <= 64:
            raise ValueError(f"num_modules must be in [1, 64], got {self.num_modules}.")
        if not 1 <= self.min_ops <= self.max_ops <= 8:
            raise ValueError(f"need 1 <= min_ops <= max_ops <= 8, got {self.min_ops}..{self.max_ops}.")
        if not 0 <= self.call_pct <= 100:
            raise ValueError(f"call_pct must be a percentage, got {self.call_pct}.")
        if not 0 <= self.long_pct <= 100:
            raise ValueError(f"long_pct must be a percentage, got {self.long_pct}.")
        if self.long_pct and not self.num_modules < self.long_modules <= 64:
            raise ValueError(f"long tasks need num_modules < long_modules <= 64, got {self.num_modules} and "
                             f"{self.long_modules}.")
        if not self.long_pct:
            object.__setattr__(self, "long_modules", 0)  # no long tasks: the knob means nothing
        if self.visible_tests < 1 or self.hidden_tests < 0 or self.visible_tests + self.hidden_tests > len(_INPUTS):
            raise ValueError(
                f"need visible_tests >= 1, hidden_tests >= 0 and at most {len(_INPUTS)} tests in all, "
                f"got {self.visible_tests} + {self.hidden_tests}."
            )

    @property
    def code(self) -> str:
        """Compact form used inside task ids."""
        return (
            f"m{self.num_modules}.s{self.min_ops}-{self.max_ops}.c{self.call_pct}"
            f".t{self.visible_tests}.h{self.hidden_tests}"
            + (f".l{self.long_pct}x{self.long_modules}" if self.long_pct else "")
        )

    def modules_of(self, seed: int, split: str) -> int:
        """How many modules the task with this seed has (``long_modules`` for the long ones)."""
        if self.long_pct and random.Random(f"xlong-v1/long/{split}/{seed}").randrange(100) < self.long_pct:
            return self.long_modules
        return self.num_modules


@dataclass(frozen=True, kw_only=True)
class ModuleSpec:
    """One module: its steps, a reference solution and its tests as (input, output)."""

    name: str
    steps: tuple[str, ...]
    reference_code: str
    tests: tuple[tuple[int, int], ...]
    visible: int
    calls: tuple[str, ...] = ()

    @property
    def expr(self) -> str:
        """The whole definition on one line, e.g. ``m1 ( x ) , mul 2 , rsub 7``."""
        return " , ".join(self.steps)

    @property
    def visible_tests(self) -> tuple[tuple[int, int], ...]:
        return self.tests[: self.visible]

    @property
    def hidden_tests(self) -> tuple[tuple[int, int], ...]:
        return self.tests[self.visible :]


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """A whole task; `module_path(name)` is where the agent's code for a module lives."""

    task_id: str
    split: str
    seed: int
    params: TaskParams
    modules: tuple[ModuleSpec, ...] = field(default=())

    @staticmethod
    def module_path(name: str) -> str:
        return f"src/{name}.gs"

    def module(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def num_tests(self) -> int:
        return sum(len(m.tests) for m in self.modules)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def step_code(step: str) -> str:
    """Reference GyreStack line of one spec step (``x``, ``m2 ( x )``, ``add 3``, ``rsub 3`` ...)."""
    toks = step.split()
    if toks == ["x"]:
        return "x"
    if len(toks) == 4 and toks[1:] == ["(", "x", ")"]:
        return f"x {toks[0]}"
    if len(toks) == 2 and toks[0] in STEP_CODE and toks[1].isdigit():
        return STEP_CODE[toks[0]].format(c=toks[1])
    raise ValueError(f"not a step of the built-in task: {step[:40]!r}")


def _gen_module(rng: random.Random, index: int, earlier: list[ModuleSpec], params: TaskParams) -> ModuleSpec:
    """One module: a start (x or a call to an earlier module), then (op, constant) steps."""
    name = f"m{index + 1}"
    modules = {m.name: m.reference_code for m in earlier}
    for _ in range(200):
        calls: tuple[str, ...] = ()
        if earlier and rng.randrange(100) < params.call_pct:
            callee = rng.choice(earlier).name
            steps, calls = [f"{callee} ( x )"], (callee,)
        else:
            steps = ["x"]
        for _step in range(rng.randint(params.min_ops, params.max_ops)):
            op = rng.choices(_STEP_WORDS, weights=_STEP_WEIGHTS)[0]
            steps.append(f"{op} {rng.randint(1, 9)}")
        code = " ".join(step_code(st) for st in steps)
        inputs = rng.sample(_INPUTS, params.visible_tests + params.hidden_tests)
        outputs = [run_program(code, x, modules=modules, name=name) for x in inputs]
        if max(abs(y) for y in outputs) > _MAX_ABS_OUTPUT:
            continue
        # Tests that all expect the same value cannot tell programs apart; resample.
        if len(set(outputs)) < min(2, len(outputs)):
            continue
        return ModuleSpec(
            name=name,
            steps=tuple(steps),
            reference_code=code,
            tests=tuple(zip(inputs, outputs, strict=True)),
            visible=params.visible_tests,
            calls=calls,
        )
    raise RuntimeError(f"could not generate module {name} within bounds; loosen the task params")


def generate_task(seed: int, params: TaskParams = TaskParams(), *, split: str = "train",
                  family: str = "xlong-v1") -> TaskSpec:
    """The task with this seed, split and knobs (deterministic); ``family`` only names its id (the
    tool family's task with a seed is the word-level family's task with that seed)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    if not 0 <= seed < 10**12:
        raise ValueError(f"seed must be in [0, 1e12), got {seed}.")
    rng = random.Random(f"xlong-v1/{split}/{seed}/{params.code}")
    modules: list[ModuleSpec] = []
    for i in range(params.modules_of(seed, split)):
        modules.append(_gen_module(rng, i, modules, params))
    task_id = f"{family}/{split}/{seed}/{params.code}"
    return TaskSpec(task_id=task_id, split=split, seed=seed, params=params, modules=tuple(modules))


def task_from_id(task_id: str) -> TaskSpec:
    """Rebuild a task from its id; raise ValueError when it is not a built-in XLong id."""
    m = _ID_RE.match(task_id)
    if m is None:
        raise ValueError(f"not a built-in XLong task id: {task_id[:80]!r}")
    family, split, seed, nm, lo, hi, call, vis, hid, long_pct, long_modules = m.groups()
    params = TaskParams(
        num_modules=int(nm),
        min_ops=int(lo),
        max_ops=int(hi),
        call_pct=int(call),
        visible_tests=int(vis),
        hidden_tests=int(hid),
        long_pct=int(long_pct or 0),
        long_modules=int(long_modules or 0),
    )
    return generate_task(int(seed), params, split=split, family=family)


def task_ids(n: int, *, split: str = "train", params: TaskParams = TaskParams(), start_seed: int = 0,
             family: str = "xlong-v1") -> list[str]:
    """Ids of `n` consecutive tasks of a split (what a job's task source hands the scheduler)."""
    return [f"{family}/{split}/{seed}/{params.code}" for seed in range(start_seed, start_seed + n)]


_KNOBS = ("num_modules", "min_ops", "max_ops", "call_pct", "visible_tests", "hidden_tests", "long_pct", "long_modules")


def _knobs(params: Mapping[str, str]) -> TaskParams:
    unknown = set(params) - {"split", "start_seed", *_KNOBS}
    if unknown:
        raise ValueError(f"generator 'xlong-v1' got unknown params {sorted(unknown)}; "
                         f"known: split, start_seed, {', '.join(_KNOBS)}")
    try:
        return TaskParams(**{k: int(params[k]) for k in _KNOBS if k in params})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generator 'xlong-v1' params are invalid: {exc}") from None


def task_generator(params: Mapping[str, str], step: int, groups: int, *, family: str = "xlong-v1") -> list[bytes]:
    """Training tasks of a job (task family ``xlong-v1``): payload ``{"task_id": ...}`` per group.

    Params: ``split`` (train), ``start_seed`` (0) and any `TaskParams` knob. Group ``g`` of step
    ``s`` gets seed ``start_seed + s * groups + g``.
    """
    knobs = _knobs(params)
    try:
        start = int(params.get("start_seed", "0")) + step * groups
    except ValueError as exc:
        raise ValueError(f"generator 'xlong-v1' params are invalid: {exc}") from None
    ids = task_ids(groups, split=params.get("split", "train"), params=knobs, start_seed=start, family=family)
    return [json.dumps({"task_id": t}).encode() for t in ids]


def heldout_tasks(params: Mapping[str, str], n: int, *, family: str = "xlong-v1") -> list[bytes]:
    """The first ``n`` held-out tasks with the job's knobs (``split`` and ``start_seed`` pick training
    tasks and are ignored here, so every evaluation of a job sees the same set)."""
    ids = task_ids(n, split="heldout", params=_knobs(params), family=family)
    return [json.dumps({"task_id": t}).encode() for t in ids]


def tool_task_generator(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    """Training tasks of family ``xlong-tools-v1`` (the tool agent's): as `task_generator`."""
    return task_generator(params, step, groups, family="xlong-tools-v1")


def tool_heldout_tasks(params: Mapping[str, str], n: int) -> list[bytes]:
    """Held-out tasks of family ``xlong-tools-v1``: as `heldout_tasks`."""
    return heldout_tasks(params, n, family="xlong-tools-v1")
