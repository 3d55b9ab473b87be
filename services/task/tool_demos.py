"""Tool-call demonstrations for the tool model's warm start: the real tool agent, a scripted policy.

`ToolDemonstrator` is a `ModelClient` that reads the prompt's last turn back and answers as the
word-level demonstrator does (services.task.demos): it follows the tool result's hint, writes every
step's line right except its habit on ``sub c`` (written as ``c swap -``, the mistake RL has to
unlearn), replies ``done`` when told to, and summarizes a context exactly. Its calls are written
in the Hermes format the gateway parses. Because the demonstrations come from the same agent and
environment as RL (services.task.tool_agent, tool_env), the warm-started model meets exactly these
formats later, through the built-in harness or a third-party loop offering the same tools.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import numpy as np

from services.task.agent import CallContext, Generation, Sampling
from services.task.demos import DemoCall, DemoNoise, Demonstrations, sloppy_line, training_sequences
from services.task.spec import TaskParams, generate_task
from services.task.tool_agent import SUMMARIZE, ToolAgentConfig, run_tool_execution
from services.task.prompts import summarize_statuses
from services.task.tool_env import DONE, render_call
from services.task.tool_tokenizer import IM_END, IM_START, ToolCodec

__all__ = ["ToolDemonstrator", "decide", "collect_tool_demonstrations", "demo_texts", "turn_snippets"]

_HINT_RE = re.compile(r"(?:next (open_module|write_line|run_tests) (m\d+)(?: step ([^<]+?))?|reply (done))\s*$")


def _last_turn(text: str) -> str:
    """Content of the turn before the generation prompt (``<|im_start|>role\\ncontent<|im_end|>``)."""
    turns = text.split(IM_START)
    last = turns[-2] if len(turns) >= 2 else ""
    return last.split("\n", 1)[-1].split(IM_END, 1)[0].strip()


def decide(text: str, rng: random.Random, noise: DemoNoise) -> str:
    """The demonstrator's reply to a rendered prompt (a tool call, ``done`` or a summary)."""
    last = _last_turn(text)
    if last == SUMMARIZE:
        return summarize_statuses(text) or "none"
    m = _HINT_RE.search(last)
    if m is None:
        return DONE
    tool, module, step, done = m.groups()
    if done:
        return DONE
    if tool == "write_line":
        fix = re.search(rf"\b{module} fail\b", text) is not None
        code = sloppy_line(step, rng, noise.fix_minus_swap_pct if fix else noise.minus_swap_pct)
        return render_call("write_line", {"module": module, "code": code})
    return render_call(tool, {"module": module})


class ToolDemonstrator:
    """A scripted `ModelClient` for tool executions; records every call it answers."""

    def __init__(self, codec: ToolCodec, noise: DemoNoise) -> None:
        self.codec, self.noise = codec, noise
        self.calls: list[DemoCall] = []

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        text = self.codec.tok.decode([int(i) for i in prompt_ids], skip_special_tokens=False)
        answer = decide(text, random.Random(sampling.seed), self.noise)
        out = np.concatenate([self.codec.encode(answer), np.asarray([self.codec.eos_id], dtype=np.int32)])
        out = out[: sampling.max_new_tokens]
        self.calls.append(DemoCall(np.asarray(prompt_ids, dtype=np.int32).copy(), out, context.role))
        return Generation(output_ids=out, logprobs=np.zeros(len(out), dtype=np.float32), weight_version=0,
                          finish_reason="stop" if out[-1] == self.codec.eos_id else "length")


def turn_snippets(calls: list[DemoCall], im_start_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each non-summary call cut down to its last turn and the reply (``<|im_start|>tool ...
    <|im_start|>assistant\\n<call>``): the short sequences of the warm start's first phase."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for c in calls:
        if c.role == "summary":
            continue  # a summary needs its whole context
        starts = np.flatnonzero(c.prompt_ids == im_start_id)
        if len(starts) < 2:
            continue
        seq = np.concatenate([c.prompt_ids[starts[-2]:], c.output_ids])
        mask = np.zeros(len(seq), dtype=bool)
        mask[len(seq) - len(c.output_ids):] = True
        out.append((seq, mask))
    return out


def _executions(codec: ToolCodec, *, num_tasks: int, params: TaskParams, agent: ToolAgentConfig, noise: DemoNoise,
                seed: int) -> Iterator[list[DemoCall]]:
    # Demo tasks come from far up the train seed range so they do not repeat RL's first tasks.
    base = 10**9 + seed * num_tasks
    for k in range(num_tasks):
        task = generate_task(base + k, params, split="train")
        demo = ToolDemonstrator(codec, noise)
        run_tool_execution(task, demo, codec=codec, config=agent, execution_id=f"tool-demo-{seed}-{k}",
                           deadline_s=float("inf"))
        yield demo.calls


def demo_texts(codec: ToolCodec, *, num_tasks: int, params: TaskParams, agent: ToolAgentConfig, noise: DemoNoise,
               seed: int = 0) -> list[str]:
    """The demonstrations' whole contexts as text (the corpus the tokenizer is trained on)."""
    texts = []
    for calls in _executions(codec, num_tasks=num_tasks, params=params, agent=agent, noise=noise, seed=seed):
        for seq, _ in training_sequences(calls):
            texts.append(codec.tok.decode([int(i) for i in seq], skip_special_tokens=False))
    return texts


def collect_tool_demonstrations(codec: ToolCodec, *, num_tasks: int, params: TaskParams, agent: ToolAgentConfig,
                                noise: DemoNoise, seed: int = 0) -> Demonstrations:
    """Run the tool agent with the demonstrator on `num_tasks` train tasks."""
    seqs: list[tuple[np.ndarray, np.ndarray]] = []
    snippets: list[tuple[np.ndarray, np.ndarray]] = []
    im_start = int(codec.encode(IM_START)[0])
    for calls in _executions(codec, num_tasks=num_tasks, params=params, agent=agent, noise=noise, seed=seed):
        seqs.extend(training_sequences(calls))
        snippets.extend(turn_snippets(calls, im_start))
    return Demonstrations(seqs, snippets)
