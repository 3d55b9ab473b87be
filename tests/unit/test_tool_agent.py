"""The built-in task as tools: the environment's results and hints, the tool agent's compaction,
sub-agents, retries and fix turns, a trained byte-level BPE whose chat template renders exactly
the ids the agent builds, and the gateway's Hermes parser reading the agent's calls."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from services.task.demos import DemoNoise
from services.task.scoring import score_workspace
from services.task.spec import TaskParams, TaskSpec, generate_task, task_from_id
from services.task.tool_agent import ToolAgentConfig, run_tool_execution
from services.task.tool_demos import ToolDemonstrator, decide, demo_texts
from services.task.tool_env import INSTRUCTIONS, TOOLS, Scope, ToolTask, parse_call, render_call
from services.task.tool_tokenizer import CHAT_TEMPLATE, ToolCodec, render_system, train_tokenizer


@pytest.fixture(scope="module")
def codec() -> ToolCodec:
    boot = ToolCodec(train_tokenizer([], vocab_size=300))
    texts = demo_texts(boot, num_tasks=20, params=TaskParams(),
                       agent=ToolAgentConfig(context_limit_tokens=1 << 30, max_new_tokens=1024), noise=DemoNoise())
    return ToolCodec(train_tokenizer(texts, vocab_size=1024))


def _weak_task() -> tuple[TaskSpec, list[str]]:
    """A task without calls between modules where some (not all) modules have a ``sub c`` step."""
    params = TaskParams(num_modules=4, min_ops=2, max_ops=3, call_pct=0)
    for seed in range(500):
        task = generate_task(seed, params)
        weak = [m.name for m in task.modules if any(s.startswith("sub ") for s in m.steps)]
        if weak and len(weak) < len(task.modules):
            return task, weak
    raise AssertionError("no suitable task")


def test_environment_results_point_at_the_next_action() -> None:
    task = generate_task(3, TaskParams(num_modules=2, min_ops=1, max_ops=1, call_pct=0))
    env, scope = ToolTask(task, fix_turns=1), Scope(("m1", "m2"))
    m1 = task.module("m1")
    res = env.call("open_module", {"module": "m1"}, scope)
    assert res.text.startswith("module m1 tests ") and res.text.endswith(f"next write_line m1 step {m1.steps[0]}")
    assert env.call("run_tests", {"module": "m1"}, scope).text.startswith("error : m1 is not written")
    assert env.call("write_line", {"module": "m1", "code": "x"}, scope).text == f"ok . next write_line m1 step {m1.steps[1]}"
    wrong = "1 1 +" if m1.reference_code != "x 1 1 + +" else "2 2 +"
    assert env.call("write_line", {"module": "m1", "code": wrong}, scope).text == "ok . next run_tests m1"
    res = env.call("run_tests", {"module": "m1"}, scope)
    assert " fail " in res.text and res.text.endswith("next open_module m1") and not res.final_fail
    env.call("open_module", {"module": "m1"}, scope)
    env.call("write_line", {"module": "m1", "code": "x"}, scope)  # call_pct=0: every module starts from x
    env.call("write_line", {"module": "m1", "code": m1.reference_code.removeprefix("x ")}, scope)
    res = env.call("run_tests", {"module": "m1"}, scope)
    assert res.text.startswith("m1 pass") and res.text.endswith("next open_module m2")
    assert env.files["src/m1.gs"].decode().split() == m1.reference_code.split()
    assert json.loads(env.files["harness/attempts.json"]) == {"m1": 2}
    # Bad calls: unknown tools, wrong arguments, modules outside the scope; nothing changes.
    before = dict(env.files)
    assert env.call("rm_rf", {}, scope).text == "error : no tool rm_rf . next open_module m2"
    assert env.call("write_line", {"module": "m2"}, scope).text.startswith("error : write_line takes module , code")
    assert env.call("open_module", {"module": "m9"}, Scope(("m2",), subagent=True)).text.startswith("error : no module m9")
    assert env.call("read_file", {"path": "src/m1.gs"}, scope).text == env.files["src/m1.gs"].decode()
    assert env.files == before


def test_tool_agent_compacts_delegates_retries_and_fixes() -> None:
    boot = ToolCodec(train_tokenizer([], vocab_size=300))
    task, weak = _weak_task()
    demo = ToolDemonstrator(boot, DemoNoise(minus_swap_pct=100, fix_minus_swap_pct=100))
    cfg = ToolAgentConfig(context_limit_tokens=4000, max_new_tokens=256, delegate_every=2, fix_turns=1, retries=1)
    result = run_tool_execution(task, demo, codec=boot, config=cfg, execution_id="e1")
    assert result.status == "finished"
    assert {n for n, ok in result.module_passed.items() if not ok} == set(weak)
    assert result.events["subagents"] == 2 and result.events["retries"] == len(weak)
    assert result.events["fix_turns"] >= len(weak) and result.events["compactions"] >= 1
    assert {c.role for c in demo.calls} == {"main", "subagent", "summary"}
    texts = [boot.tok.decode(c.prompt_ids.tolist(), skip_special_tokens=False) for c in demo.calls]
    assert all("<|im_start|>user\nsubagent for m" in t for t, c in zip(texts, demo.calls) if c.role == "subagent")
    # A retry goes back to the prompt of the call that opened the module: a prefix of the abandoned branch.
    prompts = [c.prompt_ids for c in demo.calls]
    assert any(len(a) > len(b) and np.array_equal(a[:len(b)], b) and i > j
               for i, a in enumerate(prompts) for j, b in enumerate(prompts) if demo.calls[i].role == "main")
    # The summary's own ids open the compacted context of the next call.
    s = next(i for i, c in enumerate(demo.calls) if c.role == "summary")
    summary, nxt = demo.calls[s].output_ids[:-1], demo.calls[s + 1].prompt_ids
    assert any(np.array_equal(nxt[k:k + len(summary)], summary) for k in range(len(nxt)))
    assert score_workspace(task, result.files).passed > 0


def test_tokenizer_splits_digits_and_renders_the_template_the_agent_builds(codec: ToolCodec) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=codec.tok, eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    call = render_call("write_line", {"module": "m12", "code": "7 swap -"})
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "task modules m1 m2"},
                {"role": "assistant", "content": call}, {"role": "tool", "content": "ok . next run_tests m12"}]
    tools = [{"type": "function", "function": t} for t in TOOLS]
    text = fast.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith(render_system(INSTRUCTIONS, TOOLS))
    # Turn by turn (the agent's way) and whole (the gateway's way) give the same ids.
    pieces = [render_system(INSTRUCTIONS, TOOLS), "<|im_start|>user\ntask modules m1 m2<|im_end|>\n",
              "<|im_start|>assistant\n", call, "<|im_end|>", "\n", "<|im_start|>tool\nok . next run_tests m12<|im_end|>\n",
              "<|im_start|>assistant\n"]
    assert "".join(pieces) == text
    joined = np.concatenate([codec.encode(p) for p in pieces]).tolist()
    assert fast(text, add_special_tokens=False)["input_ids"] == joined
    ids = codec.encode("m1 tests 8 -> 123")
    assert [codec.tok.id_to_token(int(i)) for i in ids][-3:] == ["1", "2", "3"]
    assert codec.tok.token_to_id("<tool_call>") is not None and codec.decode(codec.encode(call)) == call
    # Any text is representable (byte level): a third-party harness's prompt round-trips.
    other = "Résumé: naïve café ✓ — {\"x\": [1, 2]}\ttabs"
    assert codec.decode(codec.encode(other)) == other


def test_the_gateway_parses_the_agent_calls() -> None:
    from services.rollout.tools import HermesFormat

    call = render_call("write_line", {"module": "m3", "code": "4 swap -"})
    content, calls = HermesFormat().parse(call)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("write_line", {"module": "m3", "code": "4 swap -"})]
    assert parse_call(call) == ("write_line", {"module": "m3", "code": "4 swap -"})
    assert parse_call("<tool_call>\n{\"name\": \"run_tests\", \"arguments\": {\"module\": \"m1\"\n</tool_call>") is None
    assert HermesFormat().render_call(calls[0]) == call  # the format the gateway's forced calls open with


def test_a_closing_tag_inside_an_argument_is_text_to_both_parsers() -> None:
    """The harness and the gateway agree on where a call ends: at its JSON object's end, so a file
    whose text holds the closing tag (the tool model writes it as one token) is written whole."""
    from services.rollout.tools import HermesFormat

    args = {"module": "m2", "code": "</tool_call> 1 +"}
    call = render_call("write_line", args)
    assert parse_call(call) == ("write_line", args)
    assert [json.loads(c.arguments) for c in HermesFormat().parse(call)[1]] == [args]
    assert parse_call("I will write it. " + call + " done") == ("write_line", args)
    # a whole object with no closing tag after it (cut by max_tokens) is not a call; nor is prose
    assert parse_call(call[: -len("</tool_call>")]) is None
    assert parse_call('<tool_call> {"name": "run_tests", "arguments": {}} and more </tool_call>') is None
    assert parse_call("no call here") is None
    assert parse_call('<tool_call>{"name": 3, "arguments": {}}</tool_call>') is None


def test_demonstrator_follows_hints_and_keeps_its_habit() -> None:
    prompt = "<|im_start|>tool\nok . next write_line m2 step sub 3<|im_end|>\n<|im_start|>assistant\n"
    lines = {json.loads(decide(prompt, random.Random(s), DemoNoise()).split("\n")[1])["arguments"]["code"]
             for s in range(40)}
    assert lines == {"3 -", "3 swap -"}
    assert decide("<|im_start|>tool\nm4 pass 2 / 2 . reply done<|im_end|>\n<|im_start|>assistant\n",
                  random.Random(0), DemoNoise()) == "done"
    summary_prompt = ("<|im_start|>tool\nm1 pass 2 / 2 . next open_module m2<|im_end|>\n<|im_start|>tool\n"
                      "m2 fail 1 / 2 : 4 -> 1 want 2 . next open_module m2<|im_end|>\n<|im_start|>user\nsummarize"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert decide(summary_prompt, random.Random(0), DemoNoise()) == "m1 pass m2 fail"


def test_tool_family_ids_name_the_same_tasks() -> None:
    a = task_from_id("xlong-v1/train/7/m4.s1-3.c30.t2.h2")
    b = task_from_id("xlong-tools-v1/train/7/m4.s1-3.c30.t2.h2")
    assert b.task_id.startswith("xlong-tools-v1/") and a.modules == b.modules
    from services.task.registry import family_of_task

    assert family_of_task(b.task_id).name == "xlong-tools-v1"
