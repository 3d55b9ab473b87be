"""The tool-calling built-in model behind the gateway's OpenAI endpoint, driven like a third-party
harness: the official ``openai`` client offers the task's tools, executes each returned call on
the task's workspace (services.task.tool_env) and sends the result back. The model's chat
template renders the tools; forced calls (``tool_choice`` required / a named function) are
schema-valid under the grammar; the gateway's first prompt is the built-in tool agent's own ids;
the whole conversation is one trajectory path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from services.task.spec import generate_task
from services.task.tool_env import INSTRUCTIONS, TOOL_NAMES, TOOLS, Scope, ToolTask, task_message
from services.task.tool_tokenizer import ToolCodec, render_system, render_turn
from tests.support.http_stack import HttpStack, http_stack

torch.set_num_threads(1)
SERVED = "builtin-tools"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.task.tool_model import ToolModelSpec, ensure_tool_model

    return ensure_tool_model(tmp_path_factory.mktemp("models"),
                             spec=ToolModelSpec(corpus_tasks=20, demo_tasks=40, snippet_steps=40, sft_steps=20,
                                               shell_demo_tasks=0, smolagents_demo_tasks=0, claude_code_demo_tasks=0))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[HttpStack]:
    with http_stack(tmp_path_factory, model=str(model_dir), served=SERVED, job_id="job-tools",
                    max_body_bytes=1 << 20, max_context_tokens=4096, max_batch_size=4) as s:
        yield s


def test_an_openai_tool_loop_on_the_built_in_task_is_one_path(stack: HttpStack, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    task = generate_task(5)
    env, scope = ToolTask(task, fix_turns=1), Scope(tuple(m.name for m in task.modules))
    tools = [{"type": "function", "function": t} for t in TOOLS]
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": task_message(task)}]
    headers = {"x-gyre-execution-id": "ex-tools", "x-gyre-agent-id": "main"}
    turns, cut = [], 0
    for i in range(6):
        choice: Any = {"type": "function", "function": {"name": "open_module"}} if i == 0 else "required"
        for attempt in range(4):  # sampled at T=1: a call max_tokens cuts says so, and is sampled again
            resp = client.chat.completions.create(model=SERVED, messages=messages, tools=tools, tool_choice=choice,
                                                  max_tokens=48, temperature=1.0, seed=10 * i + attempt,
                                                  extra_headers=headers, extra_body={"return_token_ids": True})
            if resp.choices[0].finish_reason != "length":
                break
            cut += 1
        msg = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls" and msg.tool_calls
        turns.append(resp.model_extra["gyre"])
        call = msg.tool_calls[0]
        assert call.function.name in TOOL_NAMES and (i or call.function.name == "open_module")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])  # the grammar keeps forced calls valid
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [c.model_dump() for c in msg.tool_calls]})
        result = env.call(call.function.name, args, scope).text
        assert result  # every call gets an answer (an error result says what to do instead)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # The gateway renders the first request exactly as the built-in tool agent builds its ids.
    codec = ToolCodec.from_dir(model_dir)
    agent_ids = codec.encode(render_system(INSTRUCTIONS, TOOLS) + render_turn("user", task_message(task),
                                                                               generation_prompt=True))
    forced = turns[0]["prompt_ids"][len(agent_ids):]  # the named call's forced opening
    assert turns[0]["prompt_ids"][:len(agent_ids)] == agent_ids.tolist() and forced
    assert codec.decode(forced).startswith('<tool_call>\n{"name": "open_module", "arguments": ')
    # Each turn extends the ids of everything before: one path, no re-tokenized replies.
    for before, after in zip(turns, turns[1:]):
        earlier = before["prompt_ids"] + before["output_ids"]
        assert after["prompt_ids"][:len(earlier)] == earlier
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-tools", job_id="job-tools")
    assert stats.num_calls == 6 + cut and stats.paths == 1 + cut  # a cut call is a sibling of its resample



def test_anthropic_sdk_forced_tool_use_is_schema_valid_and_one_path(stack: HttpStack) -> None:
    """The official anthropic client against /v1/messages with the task's tools: tool_choice
    ``any`` gives a tool_use whose input is valid against its schema; its tool_result goes back;
    the two calls are one trajectory path."""
    import anthropic

    client = anthropic.Anthropic(base_url=stack.http.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                 default_headers={"x-gyre-execution-id": "ex-tools-anthropic",
                                                  "x-gyre-agent-id": "main"})
    task = generate_task(8)
    env, scope = ToolTask(task), Scope(tuple(m.name for m in task.modules))
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    messages: list[Any] = [{"role": "user", "content": task_message(task)}]
    cut = 0
    for _ in range(2):
        for attempt in range(4):  # sampled at T=1: a tool_use max_tokens cuts says so, and is sampled again
            reply = client.messages.create(model=SERVED, max_tokens=48, system=INSTRUCTIONS, messages=messages,
                                           tools=tools, tool_choice={"type": "any"},  # type: ignore[arg-type]
                                           extra_body={"temperature": 1.0})
            if reply.stop_reason != "max_tokens":
                break
            cut += 1
        assert reply.stop_reason == "tool_use"
        use = [b for b in reply.content if b.type == "tool_use"]
        assert use and use[0].name in TOOL_NAMES
        jsonschema.validate(use[0].input, schemas[use[0].name])
        result = env.call(use[0].name, dict(use[0].input), scope).text  # type: ignore[arg-type]
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                   "content": result}]}]
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-tools-anthropic", job_id="job-tools")
    assert stats.num_calls == 2 + cut and stats.paths == 1 + cut
