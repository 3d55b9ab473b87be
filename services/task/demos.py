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


def collect_demonstrations(
    *,
    num_tasks: int,
    params: TaskParams,
    agent: AgentConfig,
    noise: DemoNoise,
    codec: Codec,
    seed: int = 0,
) -> Demonstrations:
    """Run the agent with the demonstrator on `num_tasks` train tasks (seeds from a separate range)."""
    seqs: list[tuple[np.ndarray, np.ndarray]] = []
    snippets: list[tuple[np.ndarray, np.ndarray]] = []
    user_id = int(codec.encode("<|user|>")[0])
    # Demo tasks come from far up the train seed range so they do not repeat RL's first tasks.
    base = 10**9 + seed * num_tasks
    for k in range(num_tasks):
        task = generate_task(base + k, params, split="train")
        demo = Demonstrator(task, codec, noise)
        run_execution(task, demo, codec=codec, config=agent, execution_id=f"demo-{seed}-{k}", deadline_s=float("inf"))
        seqs.extend(training_sequences(demo.calls))
        snippets.extend(step_snippets(demo.calls, user_id))
    return Demonstrations(seqs, snippets)
