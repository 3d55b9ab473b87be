"""smolagents' loop in process: the gateway's endpoint code over a ModelClient (services.task.local_gateway),
and the tool model's demonstrations recorded through that loop (services.task.tool_demos)."""

from __future__ import annotations

import random

import numpy as np

from services.task.agent import CallContext, Generation, Sampling
from services.task.demos import DemoNoise
from services.task.local_gateway import LocalOpenAI
from services.task.spec import TaskParams, generate_task
from services.task.tool_demos import FINAL_ANSWER, ToolDemonstrator, run_smolagents_demo
from services.task.tool_env import INSTRUCTIONS, parse_call
from services.task.tool_tokenizer import IM_START, ToolCodec, hf_tokenizer, train_tokenizer

BOOT = ToolCodec(train_tokenizer([], vocab_size=300))


def _run(seed: int) -> tuple[ToolDemonstrator, object]:
    task = generate_task(11, TaskParams(num_modules=3))
    demo = ToolDemonstrator(BOOT, DemoNoise(), "smolagents")
    env = run_smolagents_demo(task, demo, codec=BOOT, fix_turns=1, max_turns=200, max_new_tokens=1024,
                              rng=random.Random(seed))
    return demo, env


def test_smolagents_demonstrations_run_the_task_through_its_own_loop() -> None:
    demo, env = _run(0)
    assert all(env.module_passed.values()) and len(env.module_passed) == 3  # type: ignore[attr-defined]
    texts = [BOOT.tok.decode([int(i) for i in c.prompt_ids], skip_special_tokens=False) for c in demo.calls]
    replies = [BOOT.decode(c.output_ids) for c in demo.calls]
    # every call is a required tool call: the gateway put the call's opening into the prompt
    assert all(t.endswith(f'{IM_START}assistant\n<tool_call>\n{{"name": "') for t in texts)
    calls = [parse_call('<tool_call>\n{"name": "' + r) for r in replies]
    assert calls[0] == ("open_module", {"module": "m1"}) and calls[-1] == (FINAL_ANSWER, {"answer": "done"})
    assert all(c is not None for c in calls)
    # the loop's own conversation: the task's instructions as its system prompt, its task framing,
    # its memory as "Calling tools:" / "Observation:" turns
    assert texts[0].startswith(f"{IM_START}system\n{INSTRUCTIONS}\n") and "New task:\ntask modules m1 m2 m3" in texts[0]
    assert "Calling tools:\n[{'id': 'call_" in texts[1] and f"{IM_START}user\nObservation:\nmodule m1 tests" in texts[1]
    # a function of the seed: the same prompts again (tool-call ids included)
    again, _ = _run(0)
    assert [c.prompt_ids.tolist() for c in again.calls] == [c.prompt_ids.tolist() for c in demo.calls]


class _Echo:
    """A ModelClient that answers every call with a fixed text."""

    def __init__(self, text: str) -> None:
        self.text, self.prompts = text, []  # type: ignore[var-annotated]

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        self.prompts.append(BOOT.tok.decode([int(i) for i in prompt_ids], skip_special_tokens=False))
        out = np.concatenate([BOOT.encode(self.text), [BOOT.eos_id]]).astype(np.int32)
        return Generation(output_ids=out, logprobs=np.zeros(len(out), np.float32), weight_version=3,
                          finish_reason="stop")


def test_the_local_endpoint_answers_like_the_gateway_in_the_sdks_types() -> None:
    echo = _Echo('run_tests", "arguments": {"module": "m2"}}\n</tool_call>')
    client = LocalOpenAI(echo, tokenizer=hf_tokenizer(BOOT.tok, model_max_length=4096), model_name="m",
                         max_context=4096, headers={"x-gyre-execution-id": "e"}, seed=1)
    try:
        tools = [{"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}}
                 for name in ("open_module", "run_tests")]
        res = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=tools,
                                             tool_choice="required", max_tokens=64)
        msg = res.choices[0].message
        assert res.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "run_tests"
        assert msg.tool_calls[0].function.arguments == '{"module": "m2"}'
        assert res.gyre["weight_version"] == 3  # type: ignore[attr-defined]
        assert echo.prompts[0].endswith('<tool_call>\n{"name": "') and '"name": "run_tests"' in echo.prompts[0]
        plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=64)
        assert plain.choices[0].message.content == echo.text and not plain.choices[0].message.tool_calls
    finally:
        client.close()


def test_a_call_whose_arguments_are_not_an_object_gets_the_environments_error() -> None:
    """smolagents hands a tool arguments it could not read as an object positionally; the loop's
    tools answer with the environment's own error (as in the other loops), not a Python TypeError."""
    from services.task.agent import ExecutionResult
    from services.task.loops import Tools, run_smolagents, smolagents_model

    echo = _Echo('open_module", "arguments": "m1"}\n</tool_call>')
    client = LocalOpenAI(echo, tokenizer=hf_tokenizer(BOOT.tok, model_max_length=1 << 16), model_name="m",
                         max_context=1 << 16, headers={"x-gyre-execution-id": "e"}, seed=1)
    tools = Tools(generate_task(11, TaskParams(num_modules=1)), fix_turns=1, on_progress=None, cancelled=None,
                  result=ExecutionResult(status="finished", files={}))
    model = smolagents_model("http://127.0.0.1:9/v1", "m", temperature=0.0, max_tokens=64, timeout_s=60.0)
    model.client.close()
    model.client = client
    try:
        run_smolagents(tools, model, max_turns=2)
    finally:
        client.close()
    assert "error : open_module takes a JSON object" in echo.prompts[1], echo.prompts[1][-600:]
    assert "positional argument" not in echo.prompts[1]
    assert tools.result.calls["tool"] == 2


def test_the_local_endpoint_samples_a_model_under_the_requests_grammar() -> None:
    """In process as on an engine: a forced call's arguments are sampled under its tool's schema
    (a random model's call still parses and validates), so a loop run in process sees the calls
    the live stack would give it."""
    import json

    import jsonschema

    from services.rollout.torch_engine import build_tiny_model
    from services.task.local_client import LocalModelClient

    tok = hf_tokenizer(BOOT.tok, model_max_length=4096)
    model = LocalModelClient(build_tiny_model(len(tok), max_position_embeddings=4096, seed=3), keep_records=False)
    schema = {"type": "object", "required": ["module", "code"], "properties": {
        "module": {"enum": ["m1", "m2"]}, "code": {"enum": ["x", "2 -", "3 swap -"]}}}
    tools = [{"type": "function", "function": {"name": "write_line", "parameters": schema}},
             {"type": "function", "function": {"name": "run_tests", "parameters": {
                 "type": "object", "required": ["module"], "properties": {"module": {"enum": ["m1", "m2"]}}}}}]
    client = LocalOpenAI(model, tokenizer=tok, model_name="m", max_context=4096, seed=1)
    try:
        for temperature in (0.0, 1.0, 1.0):
            res = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=tools,
                                                 tool_choice="required", max_tokens=64, temperature=temperature)
            call = res.choices[0].message.tool_calls[0].function
            args = json.loads(call.arguments)
            jsonschema.validate(args, schema if call.name == "write_line" else tools[1]["function"]["parameters"])
    finally:
        client.close()


def test_smolagents_whole_contexts_run_from_the_first_call_to_the_final_answer() -> None:
    """The warm start's whole smolagents contexts include an execution's last call (the one that
    calls final_answer): without it the model never learned to end that loop."""
    from services.task.tool_agent import ToolAgentConfig
    from services.task.tool_demos import SMOLAGENTS_CONTEXTS, collect_tool_demonstrations

    demos = collect_tool_demonstrations(BOOT, num_tasks=0, params=TaskParams(num_modules=2),
                                        agent=ToolAgentConfig(max_new_tokens=1024), noise=DemoNoise(),
                                        smolagents_tasks=1)
    texts = [BOOT.tok.decode([int(i) for i in ids], skip_special_tokens=False) for ids, _ in demos.sequences]
    assert len(texts) == SMOLAGENTS_CONTEXTS
    assert texts[0].count("Observation:") == 0 and FINAL_ANSWER in texts[-1].rsplit("<tool_call>", 1)[-1]


def test_a_call_cut_by_max_tokens_says_length_not_tool_calls() -> None:
    """A forced call that max_tokens cut keeps finish_reason "length" (as OpenAI's API), so a harness
    does not run an unfinished call; a whole one is "tool_calls"."""
    class _Cut(_Echo):
        def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                     timeout_s: float) -> Generation:
            out = BOOT.encode(self.text).astype(np.int32)
            return Generation(output_ids=out, logprobs=np.zeros(len(out), np.float32), weight_version=0,
                              finish_reason="length")

    tools = [{"type": "function", "function": {"name": "write_line", "parameters": {
        "type": "object", "properties": {"module": {"type": "string"}, "code": {"type": "string"}}}}}]
    for text, reason in (('write_line", "arguments": {"module": "m1", "co', "length"),
                         ('write_line", "arguments": {"module": "m1"}}\n</tool_call>', "tool_calls")):
        model = _Cut(text) if reason == "length" else _Echo(text)
        client = LocalOpenAI(model, tokenizer=hf_tokenizer(BOOT.tok, model_max_length=4096), model_name="m",
                             max_context=4096, seed=1, constrain=False)
        try:
            res = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                                 tools=tools, tool_choice="required", max_tokens=16)
        finally:
            client.close()
        assert res.choices[0].finish_reason == reason and res.choices[0].message.tool_calls
