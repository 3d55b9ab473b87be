"""Tool calling on the OpenAI endpoint: tool specs, tool_choice, the call formats' parsers, and the
messages a template renders (raw replies back, tool results matched to calls, the fallback block)."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.rollout.tools import (
    HermesFormat, Llama3JsonFormat, RawReplies, ToolCall, ToolChoice, format_for, parse_tool_choice, parse_tools,
    prepare_messages,
)

TOOLS = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "write_module", "description": "write a module"}}]


def test_tool_specs_and_choices_are_validated() -> None:
    tools = parse_tools(TOOLS)
    assert [t["name"] for t in tools] == ["run_tests", "write_module"]
    assert tools[1]["parameters"] == {"type": "object", "properties": {}}
    for bad, why in [("x", "must be a list"), ([{"type": "function"}], "tools\\[0\\]"),
                     ([{"function": {"name": "a b"}}], "letters"), (TOOLS + TOOLS[:1], "two tools")]:
        with pytest.raises(InvalidArgument, match=why):
            parse_tools(bad)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    assert parse_tool_choice("required", tools[:1]) == ToolChoice("named", "run_tests")
    assert parse_tool_choice({"type": "function", "function": {"name": "write_module"}}, tools) == \
        ToolChoice("named", "write_module")
    for bad, why in [("sometimes", "expected auto"), ({"function": {"name": "nope"}}, "not in 'tools'"), (3, "must be")]:
        with pytest.raises(InvalidArgument, match=why):
            parse_tool_choice(bad, tools)
    with pytest.raises(InvalidArgument, match="needs 'tools'"):
        parse_tool_choice("required", [])


def test_hermes_calls_parse_with_content_several_calls_and_truncation() -> None:
    f = HermesFormat()
    content, calls = f.parse('Let me check.\n<tool_call>\n{"name": "run_tests", "arguments": {"module": "m1"}}\n'
                             '</tool_call>\n<tool_call>{"name": "write_module", "arguments": {}}</tool_call>')
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", '{"module": "m1"}'), ("write_module", "{}")]
    assert f.parse("just text") == ("just text", [])
    assert f.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    # cut by max_tokens inside the arguments: the call keeps them as generated (OpenAI: may be invalid JSON)
    _, calls = f.parse('<tool_call>\n{"name": "run_tests", "arguments": {"module": "m')
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", '{"module": "m')]
    # the closing tag inside an argument's string is text (a model sampling code that writes the tag):
    # the call ends where its JSON object does, not at the first tag
    code = 'print("</tool_call>")\n<tool_call>'
    text = f.render_call(ToolCall("write_line", json.dumps({"module": "m2", "code": code})))
    _, calls = f.parse(text + "\n" + f.render_call(ToolCall("run_tests", '{"module": "m2"}')))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("write_line", {"module": "m2", "code": code}),
                                                                  ("run_tests", {"module": "m2"})]
    _, calls = f.parse('<tool_call>{"name": "write_line", "arguments": {"module": "m2", "code": "</tool_call> x')
    assert [(c.name, c.arguments) for c in calls] == [("write_line", '{"module": "m2", "code": "')]  # unfinished
    assert f.holdback("abc <tool") == 4 and f.holdback("abc <tool_call> {") == 4 and f.holdback("abc") == 3
    assert f.forced_prefix(ToolChoice("named", "run_tests")) == '<tool_call>\n{"name": "run_tests", "arguments": '
    assert f.forced_prefix(ToolChoice("auto")) == ""


def test_llama3_json_calls_parse() -> None:
    f = Llama3JsonFormat()
    _, calls = f.parse('<|python_tag|>{"name": "run_tests", "parameters": {"module": "m;1"}}; '
                       '{"name": "write_module", "parameters": {}}')
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", '{"module": "m;1"}'), ("write_module", "{}")]
    assert f.parse("The answer is 4.") == ("The answer is 4.", [])
    assert isinstance(format_for("{{ '<|python_tag|>' }}"), Llama3JsonFormat)
    assert isinstance(format_for("<|im_start|>"), HermesFormat)
    assert isinstance(format_for("<|im_start|>", "llama3_json"), Llama3JsonFormat)
    with pytest.raises(ValueError, match="tool_parser"):
        format_for("", "xml")


def test_messages_render_raw_replies_match_tool_results_and_carry_the_fallback_block() -> None:
    tools, f, raw = parse_tools(TOOLS), HermesFormat(), RawReplies()
    generated = 'ok <tool_call>{"name":"run_tests","arguments":{ "module":"m1" }}</tool_call>'
    raw.put(["call_a"], generated)
    history = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "go"},
               {"role": "assistant", "content": "ok", "tool_calls": [
                   {"id": "call_a", "type": "function", "function": {"name": "run_tests", "arguments": '{"module": "m1"}'}}]},
               {"role": "tool", "tool_call_id": "call_a", "content": "m1 pass 2 / 2"}]
    out = prepare_messages(history, tools, f, raw, template_tools=False)
    assert out[2] == {"role": "assistant", "content": generated}  # exactly as generated, not re-serialized
    assert out[3] == {"role": "tool", "content": "m1 pass 2 / 2", "tool_call_id": "call_a"}
    assert out[0]["content"].startswith("You write code.\n\nYou can call functions.") and "<tools>" in out[0]["content"]
    # a call this gateway returned to a tool the request does not declare (the model wrote it; the
    # client answers it, as Claude Code does with "No such tool available"): kept, as generated
    raw.put(["call_x"], '<tool_call>{"name":"write_line","arguments":{}}</tool_call>')
    stray = [history[1], {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_x", "type": "function", "function": {"name": "write_line", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "call_x", "content": "No such tool available: write_line"}]
    assert prepare_messages(stray, tools, f, raw, template_tools=True)[1]["content"] == raw.get("call_x")
    # an id this gateway never returned: rendered in the format's own syntax
    history[2]["tool_calls"][0]["id"] = "call_elsewhere"
    history[3]["tool_call_id"] = "call_elsewhere"
    out = prepare_messages(history, tools, f, raw, template_tools=True)
    assert out[2]["content"] == 'ok\n<tool_call>\n{"name": "run_tests", "arguments": {"module": "m1"}}\n</tool_call>'
    assert out[0] == {"role": "system", "content": "You write code."}  # the template renders the tools itself
    with pytest.raises(InvalidArgument, match="no earlier assistant message called"):
        prepare_messages([history[1], {"role": "tool", "tool_call_id": "x", "content": ""}], tools, f, raw,
                         template_tools=False)
    history[2]["tool_calls"][0]["function"]["name"] = "rm_rf"
    with pytest.raises(InvalidArgument, match="not in 'tools'"):
        prepare_messages(history, tools, f, raw, template_tools=False)
