"""SmolLM2-135M-Instruct end to end: a real checkpoint, its BPE tokenizer and ChatML chat template.

The engine (``--model smollm2-135m-instruct``), the gateway's tokenizer (``--tokenizer-path
smollm2-135m-instruct``) and the trainer's model are all loaded by name through
services.models.source. A multi-turn conversation driven by the official ``openai`` client, and
the arith-v1 harness over gRPC TITO, both reach a real trajectory service (real Redis) as records
whose tree has exactly one path per linear conversation. Greedy TITO output equals HF
``generate`` on the same chat prompt; the trainer's log-probs equal the engine's.

The model is loaded once per module (the first run ever converts the GGUF, ~80 s; later loads
take seconds); generations are a few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from services.models.source import DEFAULT_CACHE, SMOLLM2
from services.rollout.calls import CallMeta
from services.rollout.client import GatewayClient
from services.rollout.config import GatewayConfig
from services.rollout.engine import SamplingParams
from services.rollout.main import _load_tokenizer
from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.openai_http import OpenAIEndpoint
from services.task import arith
from services.task.gateway_client import GatewayModelClient
from tests.support.http_stack import HttpStack, http_stack

torch.set_num_threads(1)
SERVED = "smollm2-135m-instruct"


Stack = HttpStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with http_stack(tmp_path_factory, model=SMOLLM2, served=SERVED, job_id="job-smol", max_body_bytes=1 << 20,
                    max_context_tokens=2048, max_batch_size=8) as s:
        yield s


def test_openai_multi_turn_chat_is_one_trajectory_path(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list()] == [SERVED]
    headers = {"x-gyre-execution-id": "ex-openai", "x-gyre-agent-id": "main"}
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a concise assistant."}]
    users = ["What is the capital of France?", "And of Spain? Answer in one word.", "Spell it backwards."]
    turns = []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        resp = client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=8, temperature=0.7 if i == 1 else 0, seed=11,
            extra_headers=headers, extra_body={"return_token_ids": True})
        reply = resp.choices[0].message.content
        assert isinstance(reply, str)
        turns.append(resp.model_extra["gyre"])
        messages.append({"role": "assistant", "content": reply})
    # Served with SmolLM2's own ChatML template: turn 1 is that template rendered and tokenized once.
    rendered = stack.tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert turns[0]["prompt_ids"] == stack.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # Later turns start with the exact ids of everything before (no re-tokenization of replies).
    for before, after in zip(turns, turns[1:]):
        earlier = before["prompt_ids"] + before["output_ids"]
        assert after["prompt_ids"][: len(earlier)] == earlier and after["reused_prompt_tokens"] == len(earlier)
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-openai", job_id="job-smol")
    last = turns[-1]
    assert stats.num_calls == 3 and stats.paths == 1
    assert stats.unique_tokens == len(last["prompt_ids"]) + len(last["output_ids"])
    assert stats.trainable_tokens == sum(len(t["output_ids"]) for t in turns)


def test_tito_greedy_matches_hf_generate_and_trainer_logprobs(stack: Stack) -> None:
    tok = stack.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = np.asarray(tok(prompt, add_special_tokens=False)["input_ids"], np.int32)
    res = stack.gateway.client().generate(
        CallMeta(job_id="job-smol", execution_id="ex-parity", call_id="c1", agent_id="main"), ids,
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(tok.eos_token_id,)))
    with torch.no_grad():  # the engine is idle now: reuse its weights for the reference
        ref = stack.engine.model.generate(torch.from_numpy(ids[None].astype(np.int64)), do_sample=False,
                                          max_new_tokens=12, eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.eos_token_id, output_scores=True,
                                          return_dict_in_generate=True)
    want = ref.sequences[0, len(ids):].tolist()
    assert res.output_ids.tolist() == want and len(want) >= 4
    ref_lp = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(ref.scores, want)]
    np.testing.assert_allclose(res.output_logprobs, ref_lp, atol=2e-3)
    # The trainer loads the same model by name; its log-probs of the recorded tokens match the engine's.
    from services.trainer.model import build_model

    model = build_model(SMOLLM2, model_cache_dir=str(DEFAULT_CACHE)).eval()
    full = torch.from_numpy(np.concatenate([ids, res.output_ids]).astype(np.int64))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=full).logits[0, len(ids) - 1:-1].float(), -1)
    trainer_lp = logp.gather(-1, torch.from_numpy(res.output_ids.astype(np.int64))[:, None])[:, 0].numpy()
    np.testing.assert_allclose(trainer_lp, res.output_logprobs, atol=2e-3)


def test_arith_harness_over_tito_is_one_path_per_execution(stack: Stack) -> None:
    gateway = GatewayClient(stack.gateway.address)
    client = GatewayModelClient(gateway)
    try:
        for seed, temperature in ((0, 0.0), (1, 1.0)):
            task = arith.task_from_id(f"arith-v1/train/{seed}/n3.v10")
            res = arith.run_arith_execution(task, client, stack.tokenizer, job_id="job-smol",
                                            execution_id=f"ex-arith-{seed}",
                                            config=arith.ArithConfig(temperature=temperature, max_new_tokens=10))
            assert res.status == "finished" and len(res.replies) == 3
            assert arith.score(res.files, task.task_id, res.status)["score"] == res.reward
            assert stack.forwarder.flush(timeout_s=60)
            stats = stack.trajectory.execution_stats(f"ex-arith-{seed}", job_id="job-smol")
            assert stats.num_calls == 3 and stats.paths == 1
            assert stats.trainable_tokens == res.output_tokens
    finally:
        gateway.close()


def test_cache_dir_holds_the_converted_checkpoint() -> None:
    path = Path(DEFAULT_CACHE) / SMOLLM2
    assert (path / ".complete").exists() and (path / "model.safetensors").stat().st_size > 500_000_000
    assert "<|im_start|>" in (path / "chat_template.jinja").read_text()


def test_arith_eval_cli_on_the_real_model(tmp_path: Path) -> None:
    from services.task.arith_eval import main

    out = tmp_path / "eval.json"
    assert main(["--model", SMOLLM2, "--n", "2", "--turns", "1", "--concurrency", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tasks"] == 2 and report["params"] == "n1.v10" and 0.0 <= report["accuracy"] <= 1.0
    assert [r["task_id"] for r in report["results"]] == arith.task_ids(2, split="heldout",
                                                                         params=arith.ArithParams(turns=1))
    assert all(r["status"] == "finished" and len(r["replies"]) == 1 for r in report["results"])


def _chosen(gyre: dict[str, Any]) -> int:
    """Output tokens the model chose (a grammar-constrained call's forced ones are context)."""
    return len(gyre["output_ids"]) - sum(gyre.get("output_forced", []))


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_openai_tool_calls_round_trip_as_one_trajectory_path(stack: Stack) -> None:
    """The official client with tools: a forced call comes back as tool_calls (its forced opening is
    prompt context, not output), the tool result goes back, the conversation stays one path,
    streamed calls arrive as tool_calls deltas, and bad tool histories are 400s."""
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    headers = {"x-gyre-execution-id": "ex-tools", "x-gyre-agent-id": "main"}
    ids = {"return_token_ids": True}
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=SERVED, messages=messages, tools=WEATHER, max_tokens=16, temperature=0, extra_headers=headers,
        extra_body=ids, tool_choice={"type": "function", "function": {"name": "get_weather"}})  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    g1 = first.model_extra["gyre"]
    forced = stack.tokenizer('<tool_call>\n{"name": "get_weather", "arguments": ', add_special_tokens=False)
    assert g1["prompt_ids"][-len(forced["input_ids"]):] == forced["input_ids"]  # context, not policy output
    # the tools reached the model: SmolLM2's template has none, so the fallback system block lists them
    prompt = stack.tokenizer.decode(g1["prompt_ids"])
    assert "<tools>" in prompt and '"get_weather"' in prompt

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    stream = client.chat.completions.create(model=SERVED, messages=messages, tools=WEATHER, tool_choice="none",
                                            max_tokens=8, temperature=0, stream=True, extra_headers=headers,
                                            extra_body=ids)  # type: ignore[arg-type]
    chunks = list(stream)
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    g2 = chunks[-1].model_extra["gyre"]
    earlier = g1["prompt_ids"] + g1["output_ids"]
    assert g2["prompt_ids"][: len(earlier)] == earlier  # the tool-call turn re-rendered to its exact ids

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in Rome?"}]
    stream = client.chat.completions.create(model=SERVED, messages=messages, tools=WEATHER, tool_choice="required",
                                            max_tokens=16, temperature=0, stream=True, extra_headers=headers,
                                            extra_body=ids)  # type: ignore[arg-type]
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].id.startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    g3 = chunks[-1].model_extra["gyre"]
    earlier = g2["prompt_ids"] + g2["output_ids"]
    assert g3["prompt_ids"][: len(earlier)] == earlier

    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-tools", job_id="job-smol")
    assert stats.num_calls == 3 and stats.paths == 1
    assert stats.trainable_tokens == _chosen(g1) + _chosen(g2) + _chosen(g3)  # a grammar's forced tokens: context

    bad = [({"role": "tool", "tool_call_id": "call_nobody", "content": "x"}, "no earlier assistant message called"),
           ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
               "name": "launch_rockets", "arguments": "{}"}}]}, "not in 'tools'")]
    for message, why in bad:
        with pytest.raises(openai.BadRequestError, match=why):
            client.chat.completions.create(model=SERVED, messages=[messages[0], message], tools=WEATHER,
                                           max_tokens=2)  # type: ignore[arg-type, list-item]
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        client.chat.completions.create(model=SERVED, messages=messages[:1], tools=WEATHER, max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})  # type: ignore[arg-type]


def test_stop_strings_of_any_length_cut_the_text_and_the_recorded_tokens(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    headers = {"x-gyre-execution-id": "ex-stop", "x-gyre-agent-id": "main"}
    messages: list[Any] = [{"role": "user", "content": "Describe Paris in one sentence."}]
    kw: dict[str, Any] = dict(model=SERVED, max_tokens=12, temperature=0, extra_headers=headers,
                              extra_body={"return_token_ids": True})
    free = client.chat.completions.create(messages=messages, **kw)
    out = free.model_extra["gyre"]["output_ids"]
    text = free.choices[0].message.content or ""
    p = len(stack.tokenizer.decode(out[:3]))  # a stop string starting on the 4th token, several tokens long
    stop = text[p:p + 10]
    assert len(stack.tokenizer(stop, add_special_tokens=False)["input_ids"]) > 1 and text.find(stop) == p
    cut = client.chat.completions.create(messages=messages, stop=[stop], **kw)
    g = cut.model_extra["gyre"]
    assert cut.choices[0].message.content == text[:p] and cut.choices[0].finish_reason == "stop"
    assert g["output_ids"] == out[:3]  # the record holds exactly the tokens before the stop string
    streamed = client.chat.completions.create(messages=messages, stop=stop, stream=True, **kw)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[:p]
    assert chunks[-1].model_extra["gyre"]["output_ids"] == out[:3]
    # the conversation goes on from the cut reply: one path, the cut output is a prefix of the next prompt
    messages += [{"role": "assistant", "content": text[:p]}, {"role": "user", "content": "More."}]
    nxt = client.chat.completions.create(messages=messages, **kw).model_extra["gyre"]
    assert nxt["prompt_ids"][: len(g["prompt_ids"]) + 3] == g["prompt_ids"] + out[:3]
    with pytest.raises(openai.BadRequestError, match="'stop' must be"):
        client.chat.completions.create(messages=messages, stop=[""], **kw)


def test_n_samples_are_sibling_branches_and_streams_report_usage(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    messages: list[Any] = [{"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model=SERVED, messages=messages, n=3, max_tokens=6, temperature=1.0, seed=5,
                                          extra_headers={"x-gyre-execution-id": "ex-n", "x-gyre-call-id": "c1"},
                                          extra_body={"return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    gyres = [c.model_extra["gyre"] for c in resp.choices]
    assert [g["call_id"] for g in gyres] == ["c1", "c1.1", "c1.2"]
    assert len({tuple(g["prompt_ids"]) for g in gyres}) == 1  # one prompt, three samples
    assert resp.usage is not None and resp.usage.completion_tokens == sum(len(g["output_ids"]) for g in gyres)
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-n", job_id="job-smol")
    distinct = len({tuple(g["output_ids"]) for g in gyres})
    assert stats.num_calls == 3 and stats.paths == distinct  # siblings under the shared prompt
    assert stats.unique_tokens == len(gyres[0]["prompt_ids"]) + sum(len(o) for o in
                                                                    {tuple(g["output_ids"]) for g in gyres})

    chunks = list(client.chat.completions.create(
        model=SERVED, messages=messages, n=2, max_tokens=4, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-gyre-execution-id": "ex-n2"}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(texts.values())
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError, match="n must be") as bad:
        client.chat.completions.create(model=SERVED, messages=messages, n=99, max_tokens=1)
    assert bad.value.code == "invalid_request"


def test_anthropic_sdk_messages_with_tools_and_streaming_is_one_path(stack: Stack) -> None:
    """The official anthropic client against /v1/messages: a forced tool_use, its tool_result back,
    a streamed answer; recorded as TITO like chat completions, one trajectory path."""
    import anthropic

    client = anthropic.Anthropic(base_url=stack.http.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                 default_headers={"x-gyre-execution-id": "ex-anthropic", "x-gyre-agent-id": "main"})
    tools = [{"name": "get_weather", "description": "Current weather of a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=SERVED, max_tokens=16, system="You are terse.", messages=messages,
                                   tools=tools, tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[arg-type]
                                   extra_body={"temperature": 0})  # (this SDK has no temperature argument)
    assert first.stop_reason == "tool_use" and first.role == "assistant"
    use = [b for b in first.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and isinstance(use[0].input, dict)
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                               "content": "sunny, 21 C"}]}]
    with client.messages.stream(model=SERVED, max_tokens=8, system="You are terse.", messages=messages,
                                tools=tools, tool_choice={"type": "none"},  # type: ignore[arg-type]
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-anthropic", job_id="job-smol")
    assert stats.num_calls == 2 and stats.paths == 1  # the tool_use turn re-rendered to its exact ids
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=SERVED, max_tokens=0, messages=messages[:1])
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-opus", max_tokens=4, messages=messages[:1])


def _leased_session(sched: Any, job_id: str, harness_id: str) -> Any:
    """A one-execution job on ``sched``, admitted, and its lease (which carries a session base URL)."""
    from services.scheduler.jobs import Mode, TaskSource
    from services.scheduler.orchestrator import Orchestrator
    from tests.service.scheduler_support import job_spec

    class NoActuator:
        def switch(self, *args: object, **kw: object) -> None:
            raise AssertionError("no cells are registered")

    sched.client.submit_job(job_spec(job_id, num_steps=1, groups_per_step=1, group_size=1, mode=Mode.COLOCATE,
                                     tasks=TaskSource(payloads=(b"weather",))))
    assert Orchestrator(sched.state, NoActuator(), instance_id="t", metrics_event_interval_s=3600).tick()
    lease = sched.client.lease(harness_id, job_id=job_id)
    assert lease is not None and lease.session_base_url
    return lease


RESPONSES_WEATHER = [{"type": "function", "name": "get_weather", "description": "Current weather of a city.",
                      "parameters": WEATHER[0]["function"]["parameters"]}]


def test_openai_responses_api_with_tools_and_streaming_is_one_path(stack: Stack) -> None:
    """The official client's Responses API (what Codex speaks) against /v1/responses: a forced
    function call, its output sent back with the whole input (store: false), a streamed answer; one
    trajectory path; a function_call_output nobody asked for and previous_response_id are 400s."""
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    headers = {"x-gyre-execution-id": "ex-responses", "x-gyre-agent-id": "main"}
    ids = {"return_token_ids": True}
    inputs: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=SERVED, instructions="Use the tools.", input=inputs,
                                    tools=RESPONSES_WEATHER, tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=24, temperature=0, store=False, extra_headers=headers,
                                    extra_body=ids)  # type: ignore[arg-type]
    assert first.object == "response" and first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert first.usage is not None and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    g1 = first.model_extra["gyre"]

    inputs += [o.model_dump(exclude_none=True) for o in first.output]
    inputs.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"})
    events = list(client.responses.create(model=SERVED, instructions="Use the tools.", input=inputs,
                                          tools=RESPONSES_WEATHER, tool_choice="none", max_output_tokens=8,
                                          temperature=0, store=False, stream=True, extra_headers=headers,
                                          extra_body=ids))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage is not None and final.usage.output_tokens >= 1
    g2 = final.model_extra["gyre"]
    earlier = g1["prompt_ids"] + g1["output_ids"]
    assert g2["prompt_ids"][: len(earlier)] == earlier  # the call turn re-rendered to its exact ids
    # the second call reused the first one's KV in the engine's prefix cache
    assert final.usage.input_tokens_details.cached_tokens >= len(g1["prompt_ids"]) - 128

    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-responses", job_id="job-smol")
    assert stats.num_calls == 2 and stats.paths == 1
    assert stats.trainable_tokens == _chosen(g1) + _chosen(g2)

    with pytest.raises(openai.BadRequestError, match="no function_call earlier in the input made"):
        client.responses.create(model=SERVED, input=[inputs[0], {"type": "function_call_output",
                                                                 "call_id": "call_nobody", "output": "x"}],
                                max_output_tokens=2, extra_headers=headers)  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="previous_response_id is not supported"):
        client.responses.create(model=SERVED, input="and Rome?", previous_response_id=first.id, max_output_tokens=2,
                                extra_headers=headers)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.responses.create(model="gpt-5", input="hi", max_output_tokens=2, extra_headers=headers)
    assert stack.forwarder.flush(timeout_s=60)
    assert stack.trajectory.execution_stats("ex-responses", job_id="job-smol").num_calls == 2  # nothing recorded


def test_an_openai_agents_sdk_agent_on_the_responses_api(stack: Stack) -> None:
    """The Agents SDK's default model class (OpenAIResponsesModel), unmodified, against a session base
    URL: a tool-calling agent over /v1/responses, recorded as one path."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    from tests.service.scheduler_support import in_process_scheduler

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        asked.append(city)
        return "sunny, 21 C"

    with in_process_scheduler(stack.redis_url) as sched:
        lease = _leased_session(sched, "agents-responses-job", "agents-responses-harness")
        model = OpenAIResponsesModel(model=SERVED, openai_client=openai.AsyncOpenAI(
            base_url=lease.session_base_url, api_key="unused", max_retries=0))
        agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=24, temperature=0, store=False),
                      tool_use_behavior="stop_on_first_tool")
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
        assert result.final_output == "sunny, 21 C" if asked else "error" in str(result.final_output)
        assert stack.forwarder.flush(timeout_s=60)
        stats = stack.trajectory.execution_stats(lease.execution_id, job_id="agents-responses-job")
        assert stats.num_calls == 1 and stats.paths == 1 and stats.trainable_tokens > 0
        sched.client.cancel_job("agents-responses-job", "test over")


def test_an_openai_agents_sdk_agent_runs_against_a_session_base_url(stack: Stack) -> None:
    """Third-party agent code, unmodified: an openai-agents Agent with a function tool, through its
    chat-completions model, configured with nothing but a lease's session base URL."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    from tests.service.scheduler_support import in_process_scheduler

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        asked.append(city)
        return "sunny, 21 C"

    with in_process_scheduler(stack.redis_url) as sched:
        lease = _leased_session(sched, "agents-job", "agents-harness")
        model = OpenAIChatCompletionsModel(model=SERVED, openai_client=openai.AsyncOpenAI(
            base_url=lease.session_base_url, api_key="unused", max_retries=0))
        agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=24, temperature=0),
                      tool_use_behavior="stop_on_first_tool")
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
        # the SDK called the tool with the model's arguments (a 135M model often writes arguments that do
        # not fit the schema: the SDK then reports the tool's failure as the output)
        assert result.final_output == "sunny, 21 C" if asked else "error" in str(result.final_output)
        assert stack.forwarder.flush(timeout_s=60)
        stats = stack.trajectory.execution_stats(lease.execution_id, job_id="agents-job")
        assert stats.num_calls == 1 and stats.paths == 1 and stats.trainable_tokens > 0
        sched.client.cancel_job("agents-job", "test over")  # the next test's job is admitted


def test_a_smolagents_tool_calling_agent_runs_against_a_session_base_url(stack: Stack) -> None:
    """Third-party agent code, unmodified: a smolagents ToolCallingAgent (its OpenAIServerModel:
    tools, tool_choice, multi-token stop sequences) configured with nothing but a lease's session
    base URL; every model call it makes is recorded under the lease's execution."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    from tests.service.scheduler_support import in_process_scheduler

    asked: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
            city: the city's name
        """
        asked.append(city)
        return "sunny, 21 C"

    with in_process_scheduler(stack.redis_url) as sched:
        lease = _leased_session(sched, "smol-job", "smol-harness")
        model = OpenAIServerModel(model_id=SERVED, api_base=lease.session_base_url, api_key="unused",
                                  client_kwargs={"max_retries": 0}, max_tokens=24, temperature=0)
        agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=1, verbosity_level=0)
        answer = agent.run("What is the weather in Paris?")  # one tool-calling step, then its final answer call
        assert answer is not None
        steps = [s for s in agent.memory.steps if type(s).__name__ == "ActionStep"]
        assert steps and all(s.token_usage is not None and s.token_usage.output_tokens > 0 for s in steps)
        # smolagents forces a tool call (tool_choice required): the engine's grammar lets the 135M model
        # name only a tool that exists, with arguments that parse (before grammars it wrote e.g.
        # "weather_in_paris" and the step failed)
        named = [c.name for s in steps for c in (s.tool_calls or [])]
        assert named and set(named) <= {"get_weather", "final_answer"}
        assert all(s.error is None for s in steps), [str(s.error) for s in steps]
        assert stack.forwarder.flush(timeout_s=60)
        stats = stack.trajectory.execution_stats(lease.execution_id, job_id="smol-job")
        assert stats.num_calls >= 1 and stats.trainable_tokens > 0
        sched.client.cancel_job("smol-job", "test over")


# Like templates that drop earlier reasoning: an earlier assistant turn renders other than it was generated.
FORGETFUL = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{% if m['role'] == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m['content'] }}{% endif %}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_history_branches_instead_of_merging(stack: Stack) -> None:
    tokenizer = _load_tokenizer(GatewayConfig(tokenizer_path=SMOLLM2))
    tokenizer.chat_template = FORGETFUL
    endpoint = OpenAIEndpoint(stack.gateway.gateway, tokenizer=tokenizer, model_name=SERVED, job_id="job-smol")
    http = AsyncOpenAIServer(endpoint).start()
    try:
        client = openai.OpenAI(base_url=http.base_url, api_key="unused", max_retries=0, timeout=300)
        kw: dict[str, Any] = dict(model=SERVED, max_tokens=6, temperature=0, extra_body={"return_token_ids": True},
                                  extra_headers={"x-gyre-execution-id": "ex-forgetful"})
        messages: list[Any] = [{"role": "user", "content": "Name a fruit."}]
        first = client.chat.completions.create(messages=messages, **kw)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Another one."}]
        second = client.chat.completions.create(messages=messages, **kw)
    finally:
        http.stop()
    g1, g2 = first.model_extra["gyre"], second.model_extra["gyre"]
    assert g2["reused_prompt_tokens"] == 0  # the re-render diverged: tokenized as it is now
    assert g2["prompt_ids"] == tokenizer(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert g2["prompt_ids"][: len(g1["prompt_ids"]) + len(g1["output_ids"])] != g1["prompt_ids"] + g1["output_ids"]
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats("ex-forgetful", job_id="job-smol")
    assert stats.num_calls == 2 and stats.paths == 2  # a new branch, never silently merged into the first path
    assert stats.trainable_tokens == len(g1["output_ids"]) + len(g2["output_ids"])  # both outputs, each exact


def test_top_logprobs_come_from_the_engine(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    resp = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_headers={"x-gyre-execution-id": "ex-top"})
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        alts = item.top_logprobs
        assert len(alts) == 3 and [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
        # greedy: the chosen token is the most likely one, with the same logprob
        assert alts[0].token == item.token and abs(alts[0].logprob - item.logprob) < 1e-4
    text = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=3, temperature=0,
                                     logprobs=2, extra_headers={"x-gyre-execution-id": "ex-top2"})
    lp = text.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and all(len(d) == 2 for d in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       logprobs=True, top_logprobs=50)


TRIP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "by": {"enum": ["train", "plane", "car"]}},
        "required": ["city", "days", "by"], "additionalProperties": False}


def test_structured_outputs_and_forced_tool_arguments_always_match_their_schemas(stack: Stack) -> None:
    """Sampled at temperature 1 from a 135M model: response_format json_schema / json_object, and the
    arguments of a named or required tool call, parse and validate against their schemas (the engine
    masks what the grammar forbids); the SDK's follow-up turn works; the grammar's forced tokens are
    recorded as such and not trained; a schema the engine cannot enforce is a 400."""
    import jsonschema

    client = openai.OpenAI(base_url=stack.http.base_url, api_key="unused", max_retries=0, timeout=300)
    user = [{"role": "user", "content": "Plan a short trip: which city, how many days, how do I get there?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    chosen: set[tuple[int, ...]] = set()  # the samples share one prompt: a shared output prefix trains once
    for seed in range(3):
        r = client.chat.completions.create(model=SERVED, messages=user, response_format=fmt,  # type: ignore[arg-type]
                                           max_tokens=96, temperature=1.0, seed=seed,
                                           extra_headers={"x-gyre-execution-id": "ex-schema"},
                                           extra_body={"return_token_ids": True})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), TRIP)
        g = r.model_extra["gyre"]
        assert len(g["output_forced"]) == len(g["output_ids"]) and g["output_forced"][-1]  # only the stop was left
        chosen |= {tuple(g["output_ids"][: k + 1]) for k, f in enumerate(g["output_forced"]) if not f}
    anything = client.chat.completions.create(model=SERVED, messages=user, response_format={"type": "json_object"},
                                              max_tokens=96, temperature=1.0, seed=7)
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)

    # the Responses API's text.format is the same structured output (what Codex-style clients send)
    resp = client.responses.create(model=SERVED, input=user[0]["content"], max_output_tokens=96, temperature=1.0,
                                   text={"format": {"type": "json_schema", "name": "trip", "schema": TRIP,
                                                    "strict": True}}, store=False,
                                   extra_headers={"x-gyre-execution-id": "ex-schema-responses"})  # type: ignore[arg-type]
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), TRIP)

    tools = [{"type": "function", "function": {"name": "plan_trip", "description": "Book a trip.", "parameters": TRIP}},
             *WEATHER]
    messages: list[Any] = [{"role": "user", "content": "Book me a trip to Rome."}]
    for seed, choice in enumerate([{"type": "function", "function": {"name": "plan_trip"}}, "required", "required"]):
        r = client.chat.completions.create(model=SERVED, messages=messages, tools=tools, tool_choice=choice,  # type: ignore[arg-type]
                                           max_tokens=96, temperature=1.0, seed=seed,
                                           extra_headers={"x-gyre-execution-id": f"ex-tool-schema-{seed}"})
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[calls[0].function.name]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
        if seed == 0:  # the SDK's own follow-up turn, with the call and its result, goes through
            follow = client.chat.completions.create(
                model=SERVED, messages=[*messages, r.choices[0].message, {"role": "tool", "tool_call_id": calls[0].id,
                                                                          "content": "booked"}],
                tools=tools, max_tokens=8, temperature=0, extra_headers={"x-gyre-execution-id": "ex-tool-schema-0"})
            assert follow.choices[0].message is not None

    assert stack.forwarder.flush(timeout_s=60)
    assert stack.trajectory.execution_stats("ex-schema", job_id="job-smol").trainable_tokens == len(chosen)
    with pytest.raises(openai.BadRequestError, match="grammar does not compile|JSON schema"):
        client.chat.completions.create(model=SERVED, messages=user, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}})
