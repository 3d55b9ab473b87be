"""Demonstrations for the supervised warm start: the real agent loop driven by a scripted policy.

`Demonstrator` is a `ModelClient` that reads the prompt back (`prompts.parse_request`) and answers
like a careless expert: it translates every step right, except that it often writes ``sub c``
as if it were ``rsub c`` (``c swap -``), and it summarizes contexts exactly. Because the demonstrations come from running the *same* agent (same segments,
compactions, sub-agents and retries), the warm-started model sees exactly the formats it will
meet in RL.

The deliberate habit is what leaves RL room: the warm-started policy knows the format and the
translation, but prefers the wrong line for ``sub c``, so its greedy pass rate sits well below the
ceiling while sampling still finds correct programs often enough for group-relative advantages
to have signal.

`training_sequences` turns one execution's calls into maximal token sequences (every call whose
prompt + output is a prefix of a longer one is folded into it) with a mask of generated positions;
`step_snippets` cuts each call down to its last request and answer. The warm start trains on the
snippets first: a tiny model learns to copy a step's constant within a few dozen steps on short
sequences, but may sit on that plateau for hundreds of steps when it only sees long contexts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from services.task import prompts
from services.task.agent import AgentConfig, CallContext, Generation, Sampling, run_execution
from services.task.spec import TaskParams, TaskSpec, generate_task, step_code
from services.task.tokenizer import Codec

__all__ = [
    "DemoNoise",
    "Demonstrator",
    "DemoCall",
    "Demonstrations",
    "collect_demonstrations",
    "training_sequences",
    "step_snippets",
    "sloppy_line",
    "relabel_modules",
    "module_name_ids",
    "MAX_MODULE_NAMES",
]


@dataclass(frozen=True, kw_only=True)
class DemoNoise:
    """How the demonstrator errs: it often treats ``sub c`` like ``rsub c`` (writes ``c swap -``)."""

    minus_swap_pct: int | None = 60
    """Percent of ``sub c`` lines written as ``c swap -`` (wrong) in first attempts; ``rsub c``
    lines are always right. None: no habit at all.

    Above 50 the warm-started policy prefers the wrong line for ``sub c`` (so its greedy pass rate
    sits well below the ceiling) while sampling still writes the right one ~40% of the time, so
    group-relative RL sees both outcomes; fixing it is one context-specific preference to flip."""
    fix_minus_swap_pct: int | None = 60
    """The same habit in attempts after a failing report (``fix`` turns)."""

    def __post_init__(self) -> None:
        for name in ("minus_swap_pct", "fix_minus_swap_pct"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 100:
                raise ValueError(f"DemoNoise.{name} must be a percentage, got {getattr(self, name)}.")


def sloppy_line(step: str, rng: random.Random, swap_pct: int | None) -> str:
    """The demonstrator's code line for a step: right, except its habit on ``sub c`` steps."""
    line = step_code(step)
    if swap_pct is not None and step.startswith("sub ") and rng.randrange(100) < swap_pct:
        return f"{line.split()[0]} swap -"
    return line


@dataclass(frozen=True)
class DemoCall:
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    role: str


class Demonstrator:
    """A scripted `ModelClient` for one task; records every call it answers."""

    def __init__(self, task: TaskSpec, codec: Codec, noise: DemoNoise) -> None:
        self.task, self.codec, self.noise = task, codec, noise
        self.calls: list[DemoCall] = []

    def generate(
        self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *, timeout_s: float
    ) -> Generation:
        rng = random.Random(sampling.seed)
        text = self.codec.tok.decode([int(i) for i in prompt_ids], skip_special_tokens=False)
        kind, arg = prompts.parse_request(text)
        if kind == "summarize":
            answer = prompts.summarize_statuses(text)
        else:
            pct = self.noise.fix_minus_swap_pct if prompts.in_fix_turn(text) else self.noise.minus_swap_pct
            answer = sloppy_line(arg, rng, pct)
        out = np.concatenate([self.codec.encode(answer), np.asarray([self.codec.eos_id], dtype=np.int32)])
        out = out[: sampling.max_new_tokens]
        self.calls.append(DemoCall(np.asarray(prompt_ids, dtype=np.int32).copy(), out, context.role))
        return Generation(
            output_ids=out,
            logprobs=np.zeros(len(out), dtype=np.float32),
            weight_version=0,
            finish_reason="stop" if out[-1] == self.codec.eos_id else "length",
        )


def training_sequences(calls: list[DemoCall]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Maximal sequences of one execution with their loss masks (True where a call generated)."""
    fulls = [np.concatenate([c.prompt_ids, c.output_ids]) for c in calls]
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for i, seq in enumerate(fulls):
        covered = any(
            j != i and len(other) > len(seq) and np.array_equal(other[: len(seq)], seq) for j, other in enumerate(fulls)
        )
        if covered:
            continue
        mask = np.zeros(len(seq), dtype=bool)
        for c, full in zip(calls, fulls, strict=True):
            if len(full) <= len(seq) and np.array_equal(seq[: len(full)], full):
                mask[len(c.prompt_ids) : len(full)] = True
        out.append((seq, mask))
    return out


def step_snippets(calls: list[DemoCall], user_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each code-line call cut down to its last user segment + output (``<|user|> step sub 3
    <|assistant|> 3 - <eos>``): the short sequences of the warm start's first phase."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for c in calls:
        if c.role == "summary":
            continue  # a summary needs its whole context
        starts = np.flatnonzero(c.prompt_ids == user_id)
        if not len(starts):
            continue
        seq = np.concatenate([c.prompt_ids[starts[-1] :], c.output_ids])
        mask = np.zeros(len(seq), dtype=bool)
        mask[len(seq) - len(c.output_ids) :] = True
        out.append((seq, mask))
    return out


@dataclass(frozen=True)
class Demonstrations:
    """Training data of the warm start: whole-context sequences and short step snippets."""

    sequences: list[tuple[np.ndarray, np.ndarray]]
    snippets: list[tuple[np.ndarray, np.ndarray]]


MAX_MODULE_NAMES = 64  # m1..m64: the most modules a task has (TaskParams.num_modules, long_modules)


def module_name_ids(codec: Codec) -> np.ndarray:
    """Token ids of the module names ``m1 .. m64`` (one word each in the built-in vocabulary)."""
    ids = [codec.encode(f"m{i}") for i in range(1, MAX_MODULE_NAMES + 1)]
    if any(len(t) != 1 for t in ids):
        raise ValueError("the codec does not spell every module name m1..m64 as one token")
    out = np.asarray([int(t[0]) for t in ids], dtype=np.int64)
    if len(set(out.tolist())) != MAX_MODULE_NAMES:
        raise ValueError("the codec maps two module names to the same token")
    return out


def relabel_modules(calls: list[DemoCall], name_ids: np.ndarray, rng: random.Random, num_modules: int) -> list[DemoCall]:
    """The same execution with its modules renamed: ``m1 .. mN`` become N names drawn from
    ``m1 .. m64`` in increasing order (so m1 still comes first), in every prompt and answer alike.

    A demonstration task has a few modules, so without this the warm start only ever sees ``m1 ..
    m4`` called and learns to answer a call step with a favourite name instead of copying the one
    the step gives; the default job's tasks call ``m5 .. m31`` too, which no sampled answer ever
    got right, and RL cannot learn what it never samples."""
    picked = sorted(rng.sample(range(MAX_MODULE_NAMES), num_modules))
    table = np.arange(int(name_ids.max()) + 1, dtype=np.int64)
    table[name_ids[:num_modules]] = name_ids[picked]

    def rename(ids: np.ndarray) -> np.ndarray:
        out = ids.astype(np.int64, copy=True)
        inside = out < table.size
        out[inside] = table[out[inside]]
        return out.astype(ids.dtype)

    return [DemoCall(rename(c.prompt_ids), rename(c.output_ids), c.role) for c in calls]


def collect_demonstrations(
    *,
    num_tasks: int,
    params: TaskParams,
    agent: AgentConfig,
    noise: DemoNoise,
    codec: Codec,
    seed: int = 0,
    relabel_pct: int = 0,
) -> Demonstrations:
    """Run the agent with the demonstrator on `num_tasks` train tasks (seeds from a separate range);
    ``relabel_pct`` percent of them get their modules renamed (`relabel_modules`)."""
    if not 0 <= relabel_pct <= 100:
        raise ValueError(f"relabel_pct must be a percentage, got {relabel_pct}.")
    seqs: list[tuple[np.ndarray, np.ndarray]] = []
    snippets: list[tuple[np.ndarray, np.ndarray]] = []
    user_id = int(codec.encode("<|user|>")[0])
    name_ids = module_name_ids(codec) if relabel_pct else np.zeros(0, dtype=np.int64)
    rng = random.Random(f"relabel/{seed}")
    # Demo tasks come from far up the train seed range so they do not repeat RL's first tasks.
    base = 10**9 + seed * num_tasks
    for k in range(num_tasks):
        task = generate_task(base + k, params, split="train")
        demo = Demonstrator(task, codec, noise)
        run_execution(task, demo, codec=codec, config=agent, execution_id=f"demo-{seed}-{k}", deadline_s=float("inf"))
        calls = demo.calls
        if relabel_pct and rng.randrange(100) < relabel_pct:
            calls = relabel_modules(calls, name_ids, rng, len(task.modules))
        seqs.extend(training_sequences(calls))
        snippets.extend(step_snippets(calls, user_id))
    return Demonstrations(seqs, snippets)
