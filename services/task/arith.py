"""arith-v1: multi-step arithmetic as a multi-turn chat, for real instruct models (SmolLM2-135M-Instruct).

A task is a start expression and a chain of operations, asked one turn at a time; the model has
to carry its running result from turn to turn:

    system    You are a careful calculator. Reply with one equation that ends in the result.
              (then a worked exchange, ``DEMO``, that shows the format: "3 + 4 = 7", "7 * 2 = 14")
    user      What is 7 + 5?
    assistant 7 + 5 = 12                          <- scored against 12
    user      Multiply that by 3.
    assistant 12 * 3 = 36                         <- scored against 36 (the exact chain)
    user      Subtract 9 from that.
    assistant 36 - 9 = 27

Scoring is exact and partial: the answer of a turn is the last integer of the reply, and a turn
is correct iff it equals the true running value. reward = correct turns / turns; a task *passes*
when every turn is right. An execution that runs out of time is scored on the replies it made
(missing turns count as wrong).

Tasks are pure functions of their id, ``arith-v1/<split>/<seed>/n<turns>.v<max_operand>``, so the
reward scorer (``score``: a reward-service entry point) regrades from the id alone. The splits are
disjoint in content, not just in seed: a task belongs to ``heldout`` iff a hash of its problem falls
in the held-out bucket, so no held-out problem is ever trained on.

The harness (``run_arith_execution``) talks to the model through ``agent.ModelClient`` and builds
the context with ``ChatContext`` (services.task.chat_context): the chat template is rendered, and
the model's own output ids go verbatim into the next prompt, so its TITO records form one linear
path per execution. ``evaluate`` runs many executions concurrently (greedy) and reports accuracy
(``python -m services.task.arith_eval --model NAME_OR_DIR`` does it with an in-process engine).

Baseline, SmolLM2-135M-Instruct, default knobs (n3.v10), 100 held-out tasks, greedy: accuracy
0.14, mean reward 0.46, per-turn accuracy 0.76 / 0.49 / 0.14. Sampled at temperature 1 (8 train
tasks x 8): mean reward 0.19, 7 of 8 groups with non-zero reward variance (signal for GRPO).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from services.task.agent import CallContext, ExecutionTimeout, ModelClient, Sampling
from services.task.chat_context import ChatContext

__all__ = ["ArithParams", "ArithTask", "ArithConfig", "ArithResult", "ArithEval", "generate_task", "task_from_id",
           "task_ids", "score_answers", "score", "task_generator", "heldout_tasks", "run_arith_execution", "evaluate",
           "parse_answer"]

FAMILY = "arith-v1"
SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 5  # 1 in 5 problems is held out
ANSWERS_PATH = "answers.json"
SYSTEM_PROMPT = "You are a careful calculator. Reply with one equation that ends in the result."
# A worked exchange shown before every task (format only: a tiny instruct model rambles without it).
DEMO: tuple[tuple[str, str], ...] = (("What is 3 + 4?", "3 + 4 = 7"), ("Multiply that by 2.", "7 * 2 = 14"),
                                     ("Subtract 5 from that.", "14 - 5 = 9"))
_ID_RE = re.compile(r"^arith-v1/(train|heldout)/(\d{1,12})/n(\d+)\.v(\d+)$")
_INT_RE = re.compile(r"-?\d+")
_MAX_VALUE = 999  # running values stay a few digit tokens long
EndStatus = Literal["finished", "timeout", "failed"]


@dataclass(frozen=True, kw_only=True)
class ArithParams:
    """Difficulty knobs of the family."""

    turns: int = 3
    """Operations in the chain, one per user turn (the horizon)."""
    max_operand: int = 10
    """Largest operand of + and - (multipliers are 2..5)."""

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= 32:
            raise ValueError(f"turns must be in [1, 32], got {self.turns}.")
        if not 2 <= self.max_operand <= 99:
            raise ValueError(f"max_operand must be in [2, 99], got {self.max_operand}.")

    @property
    def code(self) -> str:
        return f"n{self.turns}.v{self.max_operand}"


@dataclass(frozen=True, kw_only=True)
class ArithTask:
    """One task: the user's question per turn and the exact running value after each turn."""

    task_id: str
    questions: tuple[str, ...]
    answers: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.questions) == len(self.answers) > 0, "one answer per question"


def _problem_bucket(ops: Sequence[tuple[str, int]], start: int) -> int:
    key = json.dumps([start, list(ops)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % HELDOUT_BUCKETS


def _gen_chain(rng: random.Random, params: ArithParams) -> tuple[int, list[tuple[str, int]], list[int]]:
    """Start value and (op, operand) steps with every running value in [0, _MAX_VALUE]."""
    hi = params.max_operand
    while True:
        start = rng.randint(1, hi)
        value, ops, values = start, [], []
        for turn in range(params.turns):
            choices = ["+", "-", "*"] if turn else ["+", "-"]  # turn 1 is "a + b" or "a - b"
            op = rng.choice(choices)
            n = rng.randint(2, 5) if op == "*" else rng.randint(1, hi)
            if op == "-" and n > value:
                op = "+"  # keep values non-negative
            value = value + n if op == "+" else value - n if op == "-" else value * n
            ops.append((op, n))
            values.append(value)
        if max(values) <= _MAX_VALUE:
            return start, ops, values


def _question(turn: int, start: int, op: str, n: int) -> str:
    if turn == 0:
        return f"What is {start} {op} {n}?"
    if op == "+":
        return f"Add {n} to that."
    if op == "-":
        return f"Subtract {n} from that."
    return f"Multiply that by {n}."


def generate_task(seed: int, params: ArithParams = ArithParams(), *, split: str = "train") -> ArithTask:
    """The task with this seed, split and knobs (deterministic; splits disjoint in content)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    if not 0 <= seed < 10**12:
        raise ValueError(f"seed must be in [0, 1e12), got {seed}.")
    rng = random.Random(f"{FAMILY}/{split}/{seed}/{params.code}")
    want_heldout = split == "heldout"
    while True:
        start, ops, values = _gen_chain(rng, params)
        if (_problem_bucket(ops, start) == 0) == want_heldout:
            break
    questions = tuple(_question(i, start, op, n) for i, (op, n) in enumerate(ops))
    return ArithTask(task_id=f"{FAMILY}/{split}/{seed}/{params.code}", questions=questions, answers=tuple(values))


def task_from_id(task_id: str) -> ArithTask:
    """Rebuild a task from its id; ValueError when it is not an arith-v1 id."""
    m = _ID_RE.match(task_id)
    if m is None:
        raise ValueError(f"not an arith-v1 task id: {task_id[:80]!r}")
    split, seed, turns, operand = m.groups()
    return generate_task(int(seed), ArithParams(turns=int(turns), max_operand=int(operand)), split=split)


def task_ids(n: int, *, split: str = "train", params: ArithParams = ArithParams(), start_seed: int = 0) -> list[str]:
    return [f"{FAMILY}/{split}/{seed}/{params.code}" for seed in range(start_seed, start_seed + n)]


def _knobs(params: Mapping[str, str]) -> ArithParams:
    unknown = set(params) - {"split", "start_seed", "turns", "max_operand"}
    if unknown:
        raise ValueError(f"generator arith-v1 got unknown params {sorted(unknown)}; "
                         "known: split, start_seed, turns, max_operand")
    try:
        return ArithParams(**{k: int(params[k]) for k in ("turns", "max_operand") if k in params})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generator arith-v1 params are invalid: {exc}") from None


def task_generator(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    """Training tasks of a job (task family ``arith-v1``): payload ``{"task_id": ...}`` per group;
    params ``split`` (train), ``start_seed`` (0), ``turns``, ``max_operand``."""
    knobs = _knobs(params)
    try:
        start = int(params.get("start_seed", "0")) + step * groups
    except ValueError as exc:
        raise ValueError(f"generator arith-v1 params are invalid: {exc}") from None
    ids = task_ids(groups, split=params.get("split", "train"), params=knobs, start_seed=start)
    return [json.dumps({"task_id": t}).encode() for t in ids]


def heldout_tasks(params: Mapping[str, str], n: int) -> list[bytes]:
    """The first ``n`` held-out tasks with the job's knobs (``split`` and ``start_seed`` pick training
    tasks and are ignored here, so every evaluation of a job sees the same set)."""
    ids = task_ids(n, split="heldout", params=_knobs(params))
    return [json.dumps({"task_id": t}).encode() for t in ids]


# ---------------------------------------------------------------------------------- scoring
def parse_answer(reply: str) -> int | None:
    """The last integer of a reply ("7 + 5 = 12." -> 12), None if it has none."""
    found = _INT_RE.findall(reply.replace(",", ""))
    return int(found[-1]) if found else None


@dataclass(frozen=True)
class ArithScore:
    correct: tuple[bool, ...]

    @property
    def passed(self) -> int:
        return sum(self.correct)

    @property
    def total(self) -> int:
        return len(self.correct)

    @property
    def reward(self) -> float:
        return self.passed / self.total

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total


def score_answers(task: ArithTask, replies: Sequence[str]) -> ArithScore:
    """Exact per-turn grading; turns without a reply (timeout) are wrong."""
    got = [parse_answer(r) for r in replies[: len(task.answers)]]
    got += [None] * (len(task.answers) - len(got))
    return ArithScore(tuple(g == want for g, want in zip(got, task.answers, strict=True)))


def score(files: Mapping[str, bytes], task_id: str, status: str) -> dict[str, Any]:
    """Builtin reward scorer ``arith-v1`` (also an entry point, ``services.task.arith:score``): grade
    ``answers.json`` of a workspace."""
    task = task_from_id(task_id)
    try:
        replies = json.loads(files.get(ANSWERS_PATH, b"[]").decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        replies = []
    if not isinstance(replies, list):
        replies = []
    s = score_answers(task, [r if isinstance(r, str) else "" for r in replies])
    return {"score": s.reward, "tests_passed": s.passed, "tests_total": s.total,
            "metrics": {"all_passed": float(s.all_passed), "replies": float(len(replies))}}


# ---------------------------------------------------------------------------------- harness
@dataclass(frozen=True, kw_only=True)
class ArithConfig:
    """Harness knobs of one execution."""

    max_new_tokens: int = 16
    """Generation cap of one turn (a bare answer is 1-4 tokens plus the end-of-turn id)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy (evaluation)."""
    timeout_s: float = 120.0
    """Wall-clock budget of one execution; past it the execution ends as `timeout`."""
    system_prompt: str = SYSTEM_PROMPT
    """The system message (empty: the template's default system message, if any)."""
    demo: bool = True
    """Open the conversation with the worked exchange ``DEMO`` (shows the answer format)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= 256:
            raise ValueError(f"max_new_tokens must be in [1, 256], got {self.max_new_tokens}.")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}.")


@dataclass
class ArithResult:
    """End of one execution: status, the workspace (``answers.json``) and the exact grade."""

    task_id: str
    status: EndStatus
    replies: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    reward: float = 0.0
    all_passed: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def _seed(execution_id: str, call_id: str) -> int:
    digest = hashlib.blake2b(f"{execution_id}/{call_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def run_arith_execution(task: ArithTask, client: ModelClient, tokenizer: Any, *, config: ArithConfig = ArithConfig(),
                        job_id: str = "", execution_id: str, deadline_s: float | None = None,
                        clock: Callable[[], float] = time.monotonic,
                        on_progress: Callable[[dict[str, bytes]], None] | None = None,
                        cancelled: threading.Event | None = None) -> ArithResult:
    """One execution: ask every turn, carry the model's own ids forward, grade the replies.

    Errors of the client propagate; a deadline (on ``clock``'s scale, default now + timeout_s)
    or ``cancelled`` ends the execution as ``timeout`` with the replies so far. ``on_progress``
    gets the workspace after every turn but the last (a harness preserves it with the reward
    service, so an execution that dies later is still scored on what it answered).
    """
    if deadline_s is None:
        deadline_s = clock() + config.timeout_s
    opening = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    for question, answer in DEMO if config.demo else ():
        opening += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    ctx = ChatContext(tokenizer, opening)
    result = ArithResult(task_id=task.task_id, status="finished")
    try:
        for turn, question in enumerate(task.questions):
            prompt = ctx.ask(question)
            remaining = deadline_s - clock()
            if remaining <= 0:
                raise ExecutionTimeout()
            call_id = f"main/{turn + 1}"
            context = CallContext(job_id=job_id, execution_id=execution_id, call_id=call_id, agent_id="main",
                                  role="main")
            sampling = Sampling(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                                stop_token_ids=ctx.stop_ids, seed=_seed(execution_id, call_id))
            gen = client.generate(context, prompt, sampling, timeout_s=remaining)
            result.prompt_tokens += len(prompt)
            result.output_tokens += len(gen.output_ids)
            if clock() > deadline_s:
                raise ExecutionTimeout()
            result.replies.append(ctx.answer(np.asarray(gen.output_ids, dtype=np.int32)))
            if on_progress is not None and turn + 1 < len(task.questions):
                on_progress({ANSWERS_PATH: json.dumps(result.replies).encode()})
            if cancelled is not None and cancelled.is_set():
                raise ExecutionTimeout()
    except ExecutionTimeout:
        result.status = "timeout"
    result.files = {ANSWERS_PATH: json.dumps(result.replies).encode()}
    graded = score_answers(task, result.replies)
    result.reward, result.all_passed = graded.reward, graded.all_passed
    return result


@dataclass(frozen=True)
class ArithEval:
    """Held-out evaluation: accuracy = fraction of tasks with every turn right."""

    results: tuple[ArithResult, ...]

    @property
    def accuracy(self) -> float:
        return sum(r.all_passed for r in self.results) / len(self.results)

    @property
    def mean_reward(self) -> float:
        return float(np.mean([r.reward for r in self.results]))

    @property
    def turn_accuracy(self) -> list[float]:
        """Per-turn accuracy (turn k right, whatever happened before)."""
        turns = max(len(task_from_id(r.task_id).answers) for r in self.results)
        out = []
        for k in range(turns):
            ok = [score_answers(task_from_id(r.task_id), r.replies).correct[k] for r in self.results
                  if k < len(task_from_id(r.task_id).answers)]
            out.append(sum(ok) / len(ok))
        return out


def evaluate(client: ModelClient, tokenizer: Any, *, n: int = 64, params: ArithParams = ArithParams(),
             split: str = "heldout", start_seed: int = 0, concurrency: int = 16, job_id: str = "eval",
             config: ArithConfig | None = None) -> ArithEval:
    """Greedy evaluation on ``n`` tasks of ``split``, ``concurrency`` executions at a time (so a
    batching engine serves them together)."""
    if n < 1 or concurrency < 1:
        raise ValueError(f"n and concurrency must be >= 1, got {n} and {concurrency}.")
    cfg = config or ArithConfig(temperature=0.0)
    if cfg.temperature != 0:
        raise ValueError("evaluation is greedy: config.temperature must be 0.")
    tasks = [task_from_id(t) for t in task_ids(n, split=split, params=params, start_seed=start_seed)]

    def one(i: int) -> ArithResult:
        return run_arith_execution(tasks[i], client, tokenizer, config=cfg, job_id=job_id,
                                   execution_id=f"{job_id}/{tasks[i].task_id}")

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="arith-eval") as pool:
        return ArithEval(tuple(pool.map(one, range(n))))
