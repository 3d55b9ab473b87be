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
import shlex
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from services.task.claude_code_dialect import CLAUDE_CODE_BASH_TOOL
from services.task.agent import CallContext, Generation, ModelClient, Sampling
from services.task.demos import DemoCall, DemoNoise, Demonstrations, sloppy_line, training_sequences
from services.task.spec import TaskParams, TaskSpec, generate_task
from services.task.tool_agent import SUMMARIZE, ToolAgentConfig, run_tool_execution
from services.task.prompts import summarize_statuses
from services.task.tool_env import DONE, Scope, ToolTask, parse_call, render_call
from services.task.tool_shell import (BASH_TOOL, COMMAND, SHELL_INSTRUCTIONS, SUBMIT, answer, shell_command,
                                      shell_task_message)
from services.task.tool_tokenizer import IM_END, IM_START, ToolCodec, render_system, render_turn

__all__ = ["ToolDemonstrator", "decide", "decide_shell", "decide_smolagents", "decide_claude_code",
           "collect_tool_demonstrations", "demo_texts", "turn_snippets", "run_shell_demo", "run_smolagents_demo",
           "run_claude_code_demo", "DIALECTS"]

DIALECTS = ("tools", "shell", "smolagents", "claude-code")
"""The task's tools as functions (the built-in loop, openai-agents), as the ``gyre-task`` command
behind a bash tool (mini-swe-agent; services.task.tool_shell), as functions in smolagents' own
conversation (``New task:``, ``Calling tools:`` / ``Observation:`` turns, ``final_answer`` to end),
or as ``gyre-task`` commands in Claude Code's Bash tool (services.task.claude_code_dialect: its
system, tool and turns as the pinned CLI sends them; a reply without a call ends its run)."""

FINAL_ANSWER = "final_answer"  # smolagents' tool that ends its loop
SMOLAGENTS_CONTEXTS = 6  # whole contexts trained per smolagents execution (each of its calls is one)

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


def decide_shell(text: str, rng: random.Random, noise: DemoNoise) -> str:
    """`decide` for the shell dialect: the same choice, read from a ``gyre-task`` result's hint and
    written as a bash call (``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` where it would reply done)."""
    plain = text.replace(f"next {SUBMIT}", f"reply {DONE}").replace(f"next {COMMAND} ", "next ")
    reply = decide(plain, rng, noise)
    call = parse_call(reply)
    command = SUBMIT if call is None else shell_command(*call)
    return render_call(BASH_TOOL["name"], {"command": command})


def decide_smolagents(text: str, rng: random.Random, noise: DemoNoise) -> str:
    """`decide` for smolagents' loop: the same choice, read from the last turn (the task, or an
    ``Observation:``); where it would reply done it calls ``final_answer`` (every call of that
    loop is a tool call)."""
    reply = decide(text, rng, noise)
    return render_call(FINAL_ANSWER, {"answer": DONE}) if reply == DONE else reply


def decide_claude_code(text: str, rng: random.Random, noise: DemoNoise) -> str:
    """`decide` for Claude Code's loop: the same choice as a ``gyre-task`` command in its Bash tool;
    where it would reply done (the result's hint is the shell dialect's submit command, which that
    CLI's permissions refuse) it replies ``done`` without a call, which ends the CLI's run."""
    plain = text.replace(f"next {SUBMIT}", f"reply {DONE}").replace(f"next {COMMAND} ", "next ")
    call = parse_call(decide(plain, rng, noise))
    return DONE if call is None else render_call(CLAUDE_CODE_BASH_TOOL["name"], {"command": shell_command(*call)})


_DECIDE = {"tools": decide, "shell": decide_shell, "smolagents": decide_smolagents, "claude-code": decide_claude_code}


class ToolDemonstrator:
    """A scripted `ModelClient` for tool executions; records every call it answers."""

    def __init__(self, codec: ToolCodec, noise: DemoNoise, dialect: str = "tools") -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
        self.codec, self.noise = codec, noise
        self.decide = _DECIDE[dialect]
        self.calls: list[DemoCall] = []

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        text = self.codec.tok.decode([int(i) for i in prompt_ids], skip_special_tokens=False)
        answer = self.decide(text, random.Random(sampling.seed), self.noise)
        # a forced opening (the gateway appends a required call's ``<tool_call>\n{"name": "`` to the
        # prompt) is context: the demonstrator writes the rest
        forced = text.rsplit(f"{IM_START}assistant\n", 1)[-1] if f"{IM_START}assistant\n" in text else ""
        if forced and answer.startswith(forced):
            answer = answer[len(forced):]
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


def run_shell_demo(task: TaskSpec, demo: ModelClient, *, codec: ToolCodec, fix_turns: int, max_turns: int,
                   max_new_tokens: int, rng: random.Random, temperature: float = 1.0) -> ToolTask:
    """One execution the way mini-swe-agent runs it through the gateway (services.task.loops):
    system (`SHELL_INSTRUCTIONS` and the bash tool), the task message, then call -> ``gyre-task``
    result as a tool turn, until the submit command, a reply without a call or ``max_turns``. No
    compaction, sub-agents or retries: that loop has none. Returns the workspace (``demo`` may be
    any `ModelClient`: a model, to see how it does in this dialect)."""
    env, scope = ToolTask(task, fix_turns=fix_turns), Scope(tuple(m.name for m in task.modules))
    text = (render_system(SHELL_INSTRUCTIONS, [BASH_TOOL]) + render_turn("user", shell_task_message(task))
            + f"{IM_START}assistant\n")
    ctx = codec.encode(text)
    for turn in range(max_turns):
        out = demo.generate(CallContext(job_id="", execution_id="shell-demo", call_id=f"c{turn}", agent_id="main",
                                        role="main"), ctx,
                            Sampling(temperature=temperature, max_new_tokens=max_new_tokens,
                                     stop_token_ids=(codec.eos_id,),
                                     seed=rng.randrange(1 << 31)), timeout_s=0.0)
        ctx = np.concatenate([ctx, out.output_ids])
        call = parse_call(codec.decode(out.output_ids))
        if call is None or call[1].get("command") == SUBMIT:
            return env
        try:
            argv = shlex.split(str(call[1].get("command", "")))
        except ValueError:  # what bash says to an unclosed quote, near enough
            argv = ["bash:", "syntax error"]
        if argv and argv[0] == COMMAND:
            result = answer(argv[1:], lambda name, args: env.call(name, args, scope).text, lambda: env.hint(scope))
        else:
            result = f"error : {COMMAND} only"
        ctx = np.concatenate([ctx, codec.encode("\n" + render_turn("tool", result, generation_prompt=True))])
    return env


class _Seeded:
    """A `ModelClient` that gives each unseeded call the next seed of ``rng`` (a third-party loop
    sends none; the demonstrations stay a function of the build's seed)."""

    def __init__(self, client: ModelClient, rng: random.Random) -> None:
        self.client, self.rng = client, rng

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        if sampling.seed is None:
            sampling = replace(sampling, seed=self.rng.randrange(1 << 31))
        return self.client.generate(context, prompt_ids, sampling, timeout_s=timeout_s)


def run_smolagents_demo(task: TaskSpec, demo: ModelClient, *, codec: ToolCodec, fix_turns: int, max_turns: int,
                        rng: random.Random, max_new_tokens: int | None = None, execution_id: str = "smolagents-demo",
                        temperature: float = 1.0, model_name: str = "builtin-tools", constrain: bool = True) -> ToolTask:
    """One execution the way smolagents runs it through the gateway (services.task.loops): its
    own ToolCallingAgent and client, whose requests go through the gateway's endpoint code in
    process (services.task.local_gateway), so the prompts are exactly those of a real run. Returns
    the workspace (``demo`` may be any `ModelClient`: a model, to see how it does in this loop; it
    is then sampled under the requests' grammars as on an engine, unless ``constrain`` is off)."""
    from services.task.agent import ExecutionResult
    from services.task.local_gateway import LocalOpenAI
    from services.task.loops import MAX_REPLY_TOKENS, Tools, run_smolagents, smolagents_model
    from services.task.tool_tokenizer import hf_tokenizer

    tools = Tools(task, fix_turns=fix_turns, on_progress=None, cancelled=None,
                  result=ExecutionResult(status="finished", files={}))
    local = LocalOpenAI(_Seeded(demo, rng), tokenizer=hf_tokenizer(codec.tok, model_max_length=1 << 20),
                        model_name=model_name, max_context=1 << 20, headers={"x-gyre-execution-id": execution_id},
                        seed=rng.randrange(1 << 31), constrain=constrain)
    model = smolagents_model("http://127.0.0.1:9/v1", model_name, temperature=temperature,
                             max_tokens=max_new_tokens or MAX_REPLY_TOKENS, timeout_s=600.0)
    model.client.close()
    model.client = local
    try:
        run_smolagents(tools, model, max_turns=max_turns)
    finally:
        local.close()
    return tools.env


def run_claude_code_demo(task: TaskSpec, demo: ModelClient, *, codec: ToolCodec, fix_turns: int, max_turns: int,
                         rng: random.Random, execution_id: str = "claude-code-demo",
                         model_name: str = "builtin-tools", temperature: float | None = None) -> ToolTask:
    """One execution the way the ``claude-code`` loop runs it: the task message, then each reply's
    Bash call run (a ``gyre-task`` command against the task's tools; any other command gets the
    CLI's permission refusal) and its output sent back, until a reply without a call or
    ``max_turns``. Returns the workspace (``demo`` may be any `ModelClient`: a model, to see how it
    does in this loop; ``temperature`` None samples at the endpoint's default, as the CLI does)."""
    from services.rollout.anthropic_http import from_chat, to_chat
    from services.task.claude_code_dialect import CLAUDE_CODE_BASH_TOOL, claude_code_request, permission_refusal
    from services.task.local_gateway import LocalOpenAI
    from services.task.tool_tokenizer import hf_tokenizer

    tokenizer = hf_tokenizer(codec.tok, model_max_length=1 << 20)
    env, scope = ToolTask(task, fix_turns=fix_turns), Scope(tuple(m.name for m in task.modules))
    local = LocalOpenAI(_Seeded(demo, rng), tokenizer=tokenizer, model_name=model_name, max_context=1 << 20,
                        headers={"x-gyre-execution-id": execution_id}, seed=rng.randrange(1 << 31), constrain=False)
    fingerprint = f"{rng.randrange(1 << 12):03x}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": shell_task_message(task)}]
    try:
        for _ in range(max_turns):
            body = claude_code_request(messages, fingerprint=fingerprint, model=model_name)
            if temperature is not None:
                body["temperature"] = temperature
            result, _ = local.endpoint.chat(to_chat(body), local.headers)
            assert result is not None
            reply = from_chat(result, model_name)
            content = reply["content"]  # the CLI sends the reply back as it came (the gateway's tool-use ids)
            calls = [b for b in content if b["type"] == "tool_use"]
            if not calls:
                break
            messages.append({"role": "assistant", "content": content})
            results = []
            for call in calls:
                command = str(call["input"].get("command", "")) if isinstance(call["input"], dict) else ""
                try:
                    argv = shlex.split(command)
                except ValueError:
                    argv = []
                if call["name"] == CLAUDE_CODE_BASH_TOOL["name"] and argv and argv[0] == COMMAND:
                    out = answer(argv[1:], lambda name, args: env.call(name, args, scope).text, lambda: env.hint(scope))
                    results.append({"tool_use_id": call["id"], "type": "tool_result", "content": out, "is_error": False})
                else:
                    results.append({"tool_use_id": call["id"], "type": "tool_result", "is_error": True,
                                    "content": permission_refusal(call["name"])})
            messages.append({"role": "user", "content": results})
    finally:
        local.close()
    return env


def _executions(codec: ToolCodec, *, num_tasks: int, params: TaskParams, agent: ToolAgentConfig, noise: DemoNoise,
                seed: int, dialect: str = "tools") -> Iterator[list[DemoCall]]:
    # Demo tasks come from far up the train seed range so they do not repeat RL's first tasks.
    base = 10**9 + seed * num_tasks + 10**8 * DIALECTS.index(dialect)
    for k in range(num_tasks):
        task = generate_task(base + k, params, split="train")
        demo = ToolDemonstrator(codec, noise, dialect)
        steps = sum(len(m.steps) + 2 for m in task.modules)
        if dialect == "shell":
            run_shell_demo(task, demo, codec=codec, fix_turns=agent.fix_turns, max_turns=agent.calls_per_step * steps,
                           max_new_tokens=agent.max_new_tokens, rng=random.Random(base + k))
        elif dialect == "smolagents":
            run_smolagents_demo(task, demo, codec=codec, fix_turns=agent.fix_turns,
                                max_turns=agent.calls_per_step * steps, rng=random.Random(base + k),
                                max_new_tokens=agent.max_new_tokens, execution_id=f"smolagents-demo-{seed}-{k}",
                                constrain=False)  # the scripted demonstrator writes valid calls; it cannot mask
        elif dialect == "claude-code":
            run_claude_code_demo(task, demo, codec=codec, fix_turns=agent.fix_turns,
                                 max_turns=agent.calls_per_step * steps, rng=random.Random(base + k),
                                 execution_id=f"claude-code-demo-{seed}-{k}")
        else:
            run_tool_execution(task, demo, codec=codec, config=agent, execution_id=f"tool-demo-{seed}-{k}",
                               deadline_s=float("inf"))
        yield demo.calls


def demo_texts(codec: ToolCodec, *, num_tasks: int, params: TaskParams, agent: ToolAgentConfig, noise: DemoNoise,
               seed: int = 0, dialect: str = "tools") -> list[str]:
    """The demonstrations' whole contexts as text (the corpus the tokenizer is trained on)."""
    texts = []
    for calls in _executions(codec, num_tasks=num_tasks, params=params, agent=agent, noise=noise, seed=seed,
                             dialect=dialect):
        for seq, _ in training_sequences(calls):
            texts.append(codec.tok.decode([int(i) for i in seq], skip_special_tokens=False))
    return texts


def collect_tool_demonstrations(codec: ToolCodec, *, num_tasks: int, params: TaskParams, agent: ToolAgentConfig,
                                noise: DemoNoise, seed: int = 0, shell_tasks: int = 0,
                                smolagents_tasks: int = 0, claude_code_tasks: int = 0) -> Demonstrations:
    """Run the tool agent with the demonstrator on `num_tasks` train tasks, the shell dialect's
    loop on `shell_tasks` others, smolagents' loop on `smolagents_tasks` more and Claude Code's on
    `claude_code_tasks` more."""
    seqs: list[tuple[np.ndarray, np.ndarray]] = []
    snippets: list[tuple[np.ndarray, np.ndarray]] = []
    im_start = int(codec.encode(IM_START)[0])
    for dialect, n in (("tools", num_tasks), ("shell", shell_tasks), ("smolagents", smolagents_tasks),
                       ("claude-code", claude_code_tasks)):
        for calls in _executions(codec, num_tasks=n, params=params, agent=agent, noise=noise, seed=seed,
                                 dialect=dialect):
            whole = training_sequences(calls)
            if dialect == "smolagents" and whole:
                # that loop rewrites its history, so each call is a sequence of its own (a long prompt,
                # one short reply): every call's last turn is a snippet, and a few whole contexts,
                # spread over the execution from its first call to its last, keep the cost of its
                # long prompts bounded
                last = len(whole) - 1
                keep = {round(i * last / max(1, SMOLAGENTS_CONTEXTS - 1)) for i in range(SMOLAGENTS_CONTEXTS)}
                # the first and the last call among them: the last is the one that calls final_answer
                whole = [whole[i] for i in sorted(keep)]
            seqs.extend(whole)
            snippets.extend(turn_snippets(calls, im_start))
    return Demonstrations(seqs, snippets)
