"""Third-party agent loops, unmodified, running the built-in task's tools (``gyre run --harness NAME``).

The built-in harness leases an execution as always; instead of its own tool agent
(services.task.tool_agent) it hands the task to a third-party loop configured with nothing but the
lease's session base URL (``http://GATEWAY/s/<token>/v1``: the gateway records every call the
loop makes as TITO under the lease's execution) and the task's tools (services.task.tool_env),
executed on the execution's workspace:

    lease ──> ToolTask(workspace) ──tools──> LOOP (openai-agents Agent / smolagents ToolCallingAgent)
                                                  │ chat completions with tools
                                                  v
                                  gateway session URL ──> engines (TITO recorded) ──> trajectory
    loop ends (final reply, turn cap, deadline) ──> workspace ──> reward (as for the built-in loop)

What the loops bring is theirs: their own prompts, message formats and stopping rules; no
compaction, sub-agents or branch retries (those are the built-in tool agent's). A tool call the
loop makes with bad arguments gets the environment's ``error`` result, as in the built-in loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common.bwrap import command_sandbox_args

if TYPE_CHECKING:  # light at import: the CLI and the harness config read LOOPS
    from services.task.agent import ExecutionResult
    from services.task.spec import TaskSpec

__all__ = ["LOOPS", "THIRD_PARTY_LOOPS", "MAX_REPLY_TOKENS", "Tools", "run_third_party", "run_smolagents",
           "smolagents_agent", "smolagents_model"]

THIRD_PARTY_LOOPS = ("openai-agents", "smolagents", "mini-swe-agent", "claude-code", "codex")
LOOPS = ("builtin", *THIRD_PARTY_LOOPS)
MAX_REPLY_TOKENS = 48  # a loop's max_tokens per call: the longest tool call the task needs, with room


class Tools:
    """The task's tools on one workspace, with the execution's progress, deadline and cancellation."""

    def __init__(self, task: TaskSpec, *, fix_turns: int, on_progress: Callable[[dict[str, bytes]], None] | None,
                 cancelled: threading.Event | None, result: ExecutionResult) -> None:
        from services.task.tool_env import Scope, ToolTask

        self.env = ToolTask(task, fix_turns=fix_turns)
        self.scope = Scope(tuple(m.name for m in task.modules))
        self.on_progress, self.cancelled, self.result = on_progress, cancelled, result

    def call(self, name: str, arguments: Any) -> str:
        from services.task.agent import ExecutionCancelled

        if self.cancelled is not None and self.cancelled.is_set():
            raise ExecutionCancelled()
        self.result.calls["tool"] += 1
        if not isinstance(arguments, dict):
            return f"error : {name} takes a JSON object . {self.env.hint(self.scope)}"
        res = self.env.call(name, arguments, self.scope)
        if res.run is not None:
            self.env.export(self.result)
            if self.on_progress is not None:
                self.on_progress(dict(self.result.files))
        return res.text


def _served_model(base_url: str, timeout_s: float) -> str:
    import openai

    with openai.OpenAI(base_url=base_url, api_key="gyre", max_retries=2, timeout=min(30.0, timeout_s)) as client:
        return str(client.models.list().data[0].id)


def _openai_agents(tools: Tools, base_url: str, *, temperature: float, max_turns: int, timeout_s: float) -> str:
    import openai
    from agents import Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

    from services.task.tool_env import INSTRUCTIONS, TOOLS, task_message

    set_tracing_disabled(True)  # nothing leaves the machine

    def tool(spec: dict[str, Any]) -> FunctionTool:
        async def invoke(_ctx: Any, args: str) -> str:
            try:
                arguments = json.loads(args or "{}")
            except json.JSONDecodeError:
                arguments = None
            return tools.call(spec["name"], arguments)

        return FunctionTool(name=spec["name"], description=spec["description"], params_json_schema=spec["parameters"],
                            on_invoke_tool=invoke, strict_json_schema=False)

    served = _served_model(base_url, timeout_s)

    async def run() -> str:
        # the client is closed before the loop ends (its connections are not left to the gateway's idle timeout)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="gyre", max_retries=3, timeout=timeout_s) as client:
            model = OpenAIChatCompletionsModel(model=served, openai_client=client)
            agent = Agent(name="gyre-task", instructions=INSTRUCTIONS, tools=[tool(t) for t in TOOLS], model=model,
                          model_settings=ModelSettings(temperature=temperature, max_tokens=MAX_REPLY_TOKENS))
            try:
                out = await asyncio.wait_for(Runner.run(agent, task_message(tools.env.task), max_turns=max_turns),
                                             timeout=timeout_s)
                return "final_reply" if out.final_output is not None else "no_reply"
            except MaxTurnsExceeded:
                return "turn_cap"
            except ModelBehaviorError:  # the model called a tool that does not exist, or wrote bad JSON:
                return "loop_gave_up"  # the SDK ends the run; the workspace so far is what gets scored

    return asyncio.run(run())


def smolagents_agent(tools: Tools, model: Any, *, max_turns: int) -> Any:
    """smolagents' ToolCallingAgent on the task's tools. Its system prompt is the task's
    instructions, as the other loops get them (openai-agents' ``instructions``, mini-swe-agent's
    system template); the rest is the loop's own: its task framing (``New task:``), its memory
    rendered back as ``Calling tools:`` / ``Observation:`` turns, every call a tool call
    (``tool_choice: required``), and its ``final_answer`` tool to end."""
    from importlib.resources import files

    import yaml  # type: ignore[import-untyped]
    from smolagents import Tool, ToolCallingAgent

    from services.task.tool_env import INSTRUCTIONS, TOOLS

    def tool(spec: dict[str, Any]) -> Tool:
        props = spec["parameters"]["properties"]
        inputs = {k: {"type": "string", "description": k} for k in props}
        name = spec["name"]

        class TaskTool(Tool):
            skip_forward_signature_validation = True

            def forward(self, *args: Any, **kwargs: Any) -> str:
                # smolagents passes arguments it could not parse as an object positionally (a string):
                # the environment's own error for arguments that are not a JSON object, as in the other loops
                return tools.call(name, args[0] if args and not kwargs else kwargs)

        TaskTool.name, TaskTool.description, TaskTool.inputs, TaskTool.output_type = (
            name, spec["description"], inputs, "string")
        return TaskTool()

    templates = yaml.safe_load(files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text())
    templates["system_prompt"] = INSTRUCTIONS
    return ToolCallingAgent(tools=[tool(t) for t in TOOLS], model=model, max_steps=max_turns, verbosity_level=0,
                            prompt_templates=templates)


def run_smolagents(tools: Tools, model: Any, *, max_turns: int) -> str:
    """One task through `smolagents_agent` with ``model`` (a smolagents model); how the loop ended."""
    from services.task.tool_env import task_message

    agent = smolagents_agent(tools, model, max_turns=max_turns)
    agent.run(task_message(tools.env.task))
    return "turn_cap" if len(agent.memory.steps) > max_turns else "final_reply"


def smolagents_model(base_url: str, model_id: str, *, temperature: float, max_tokens: int, timeout_s: float) -> Any:
    """smolagents' client of an OpenAI-compatible server (the gateway's session URL)."""
    from smolagents import OpenAIServerModel

    return OpenAIServerModel(model_id=model_id, api_base=base_url, api_key="gyre", temperature=temperature,
                             max_tokens=max_tokens, client_kwargs={"timeout": timeout_s})


def _smolagents(tools: Tools, base_url: str, *, temperature: float, max_turns: int, timeout_s: float) -> str:
    model = smolagents_model(base_url, _served_model(base_url, timeout_s), temperature=temperature,
                             max_tokens=MAX_REPLY_TOKENS, timeout_s=timeout_s)
    try:
        return run_smolagents(tools, model, max_turns=max_turns)
    finally:
        model.client.close()


def _mini_swe_agent(tools: Tools, base_url: str, *, temperature: float, max_turns: int, timeout_s: float) -> str:
    """mini-swe-agent (PyPI, pinned, its ``mini`` CLI unmodified) in a process of its own: its
    model is the session URL, its commands run in bubblewrap (no network) in a fresh working
    directory where ``gyre-task`` reaches this execution's tools over a Unix socket."""
    import shutil
    import signal
    import subprocess

    from services.common.children import scratch_dir, tied
    from services.task.agent import ExecutionCancelled
    from services.task.cli_loops import wait_for_cli
    from services.task.clis import MINI_SWE_AGENT, pip_cli
    from services.task.tool_shell import SHELL_INSTRUCTIONS, TaskSocket, answer, install_client, shell_task_message

    if shutil.which("bwrap") is None:
        raise RuntimeError("the mini-swe-agent loop runs its commands in bubblewrap: install it "
                           "(apt-get install bubblewrap; `make install` does it as root)")
    exe = pip_cli(*MINI_SWE_AGENT)
    served = _served_model(base_url, timeout_s)

    def handle(argv: list[str]) -> str:
        tools.result.events["gyre_task_commands"] += 1
        try:
            return answer(argv, tools.call, lambda: tools.env.hint(tools.scope))
        except ExecutionCancelled:  # the wait below sees the cancellation and ends the run
            return "error : the execution was cancelled"

    root = scratch_dir("gyre-mini-")  # a killed harness's are swept here
    work, bin_dir = root / "work", root / "bin"
    work.mkdir()
    install_client(bin_dir)
    server = TaskSocket(bin_dir / "task.sock", handle)
    config = {
        "agent": {"system_template": SHELL_INSTRUCTIONS, "instance_template": "{{task}}", "step_limit": max_turns,
                  "cost_limit": 0, "mode": "yolo"},
        "model": {"observation_template": "{{ output.output | trim }}{% if output.exception_info %} "
                                          "{{ output.exception_info }}{% endif %}",
                  "cost_tracking": "ignore_errors",
                  "model_kwargs": {"api_base": base_url, "temperature": temperature, "max_tokens": MAX_REPLY_TOKENS}},
        "environment": {"environment_class": "bubblewrap", "cwd": str(work), "timeout": 30,
                        "env": {"HOME": str(work)}, "wrapper_args": command_sandbox_args(bin_dir)},
    }
    (root / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    trajectory = root / "trajectory.json"
    argv = [str(exe), "-m", f"openai/{served}", "-t", shell_task_message(tools.env.task), "-y", "--exit-immediately",
            "-o", str(trajectory), "-c", "mini.yaml", "-c", str(root / "config.yaml")]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root), "LANG": "C.UTF-8",
           "OPENAI_API_KEY": "gyre",  # the session URL is the credential; litellm wants a key set
           "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    log_file = open(root / "mini.log", "wb")  # noqa: SIM115 -- closed in the finally below
    # tied: the CLI dies with this thread's process, even by SIGKILL (its sandboxes die with it)
    proc = subprocess.Popen(tied(argv), cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                            start_new_session=True)
    try:
        wait_for_cli(proc, tools, timeout_s, "mini-swe-agent")
        stderr = (root / "mini.log").read_text(errors="replace")
        try:
            status = json.loads(trajectory.read_text())["info"]["exit_status"]
        except (OSError, ValueError, KeyError, TypeError):
            raise RuntimeError(f"mini-swe-agent exited {proc.returncode} without a trajectory: "
                               f"{stderr.strip()[-500:]}") from None
        return {"Submitted": "final_reply", "LimitsExceeded": "turn_cap"}.get(str(status), "loop_gave_up")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log_file.close()
        server.close()
        shutil.rmtree(root, ignore_errors=True)


def run_third_party(loop: str, task: TaskSpec, *, base_url: str, temperature: float, fix_turns: int = 1,
                    deadline_s: float, clock: Callable[[], float] = time.time,
                    on_progress: Callable[[dict[str, bytes]], None] | None = None,
                    cancelled: threading.Event | None = None) -> ExecutionResult:
    """One execution of ``task`` through ``loop`` against the session ``base_url``; ends finished
    (the loop stopped: a final reply or its turn cap), timeout (past ``deadline_s``, on ``clock``'s
    scale) or failed (cancelled). Errors of the model calls propagate."""
    from services.task.agent import ExecutionCancelled, ExecutionResult

    if loop not in THIRD_PARTY_LOOPS:
        raise ValueError(f"loop {loop!r} is not a third-party loop; expected one of {', '.join(THIRD_PARTY_LOOPS)}")
    if not base_url:
        raise ValueError("this lease has no session base URL: the gateway's HTTP endpoint is off (http_port)")
    result = ExecutionResult(status="finished", files={})
    tools = Tools(task, fix_turns=fix_turns, on_progress=on_progress, cancelled=cancelled, result=result)
    max_turns = 6 * sum(len(m.steps) + 2 for m in task.modules)  # as the built-in tool agent's call cap
    timeout_s = deadline_s - clock()
    if timeout_s <= 0:
        result.status = "timeout"
        return result
    try:
        if loop in ("claude-code", "codex"):  # the CLI samples as it does (its own temperature)
            from services.task.cli_loops import run_cli

            ended = run_cli(loop, tools, base_url, max_turns=max_turns, timeout_s=timeout_s, served=_served_model)
        else:
            run = {"openai-agents": _openai_agents, "smolagents": _smolagents, "mini-swe-agent": _mini_swe_agent}[loop]
            ended = run(tools, base_url, temperature=temperature, max_turns=max_turns, timeout_s=timeout_s)
        result.events[ended] += 1
    except (TimeoutError, asyncio.TimeoutError):
        result.status = "timeout"
    except ExecutionCancelled:
        result.status, result.error = "failed", "cancelled"
    tools.env.export(result)
    return result
