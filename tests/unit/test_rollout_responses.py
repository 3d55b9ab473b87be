"""The Responses API translation: requests to chat calls, replies and streams back to responses."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.rollout.responses_http import from_chat, stream_from_chat, to_chat

TOOL = {"type": "function", "name": "run_tests", "description": "run them", "parameters": {"type": "object"}}


def test_a_responses_request_becomes_the_equivalent_chat_call() -> None:
    chat = to_chat({"model": "gyre", "instructions": "be brief", "max_output_tokens": 9, "tools": [TOOL],
                    "tool_choice": {"type": "function", "name": "run_tests"}, "temperature": 0, "store": False,
                    "input": [{"role": "developer", "content": "repo at /w"},
                              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
                              {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
                              {"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                              {"type": "function_call", "call_id": "c1", "name": "run_tests", "arguments": '{"m": 1}'},
                              {"type": "function_call", "call_id": "c2", "name": "run_tests", "arguments": "{}"},
                              {"type": "function_call_output", "call_id": "c1", "output": "pass"},
                              {"type": "function_call_output", "call_id": "c2",
                               "output": [{"type": "input_text", "text": "fail"}]},
                              {"role": "user", "content": "next"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "repo at /w"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": '{"m": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "pass"}, {"role": "tool", "tool_call_id": "c2", "content": "fail"},
        {"role": "user", "content": "next"}]
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0 and chat["stream"] is False
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "run_tests"}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "run_tests", "description": "run them",
                                                               "parameters": {"type": "object"}}}]
    # a bare string input is one user message; calls with no text open their own assistant turn
    assert to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    only_calls = to_chat({"input": [{"role": "user", "content": "x"},
                                    {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "a", "output": "1"}]})["messages"]
    assert only_calls[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_codex_tools_namespaces_flatten_and_hosted_tools_are_not_offered() -> None:
    fn = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
    chat = to_chat({"input": "x", "tools": [fn, {"type": "web_search", "external_web_access": False},
                                            {"type": "namespace", "name": "multi_agent_v1", "description": "d",
                                             "tools": [{**fn, "name": "close_agent"}]}]})
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "close_agent"]
    assert "tools" not in to_chat({"input": "x", "tools": [{"type": "web_search"}]})


def test_text_format_is_the_chat_response_format_and_its_grammar() -> None:
    from services.rollout.grammar import GrammarSpec
    from services.rollout.openai_http import response_grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema,
                                                      "strict": True}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                               "strict": True}}
    assert response_grammar(chat["response_format"]) == GrammarSpec("json_schema", json.dumps(schema))
    assert response_grammar(to_chat({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"]) \
        == GrammarSpec("json_object")
    assert response_grammar(to_chat({"input": "x", "text": {"format": {"type": "text"}}})["response_format"]) is None
    with pytest.raises(InvalidArgument, match="response_format type must be"):
        response_grammar({"type": "xml"})


@pytest.mark.parametrize("body, why", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "item type 'web_search_call' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "function_call_output", "call_id": "never", "output": "x"}]}, "no function_call"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id and a name"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be"),
    ({"input": [{"role": "system", "content": "x"}]}, "no message to answer"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "custom", "name": "grammar_tool"}]}, "tool type 'custom'"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns"}]}, "a namespace tool needs a list"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format json_schema needs a 'schema'"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format type must be"),
])
def test_bad_requests_are_one_sentence(body: dict, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        to_chat(body)


def test_replies_and_streams_come_back_as_responses() -> None:
    body = {"input": "x", "tools": [TOOL], "max_output_tokens": 5}
    resp = {"id": "chatcmpl-abc", "created": 7, "choices": [{"finish_reason": "tool_calls", "message": {
        "content": "checking", "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": '{"a": 2}'}}]}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}
    out = from_chat(resp, body, "gyre")
    assert out["id"] == "resp_abc" and out["object"] == "response" and out["status"] == "completed"
    assert [i["type"] for i in out["output"]] == ["message", "function_call"]
    assert out["output"][0]["content"] == [{"type": "output_text", "text": "checking", "annotations": []}]
    call = out["output"][1]
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == ("call_1", "f", '{"a": 2}', "completed")
    assert out["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}
    assert out["tools"] == [TOOL] and out["max_output_tokens"] == 5
    cut = from_chat({**resp, "choices": [{"finish_reason": "length", "message": {"content": "abc"}}]}, body, "gyre")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}

    def sse(obj: object) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    chunks = [sse({"id": "chatcmpl-x", "created": 1, "choices": [{"delta": {"role": "assistant", "content": ""}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {"content": "hi "}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {"content": "there"}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {"tool_calls": [
                  {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {}, "finish_reason": "tool_calls"}],
                   "usage": {"prompt_tokens": 4, "completion_tokens": 6}}),
              b"data: [DONE]\n\n"]
    events = []
    for raw in stream_from_chat(iter(chunks), body, "gyre"):
        kind, data = raw.decode().strip().split("\n")
        ev = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {ev['type']}"
        events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 6
    assert done["output"][0]["content"][0]["text"] == "hi there"
    assert done["output"][1]["call_id"] == "call_9" and done["output"][1]["status"] == "completed"
    failed = list(stream_from_chat(iter([sse({"error": {"message": "engine gone", "code": "server_error"}})]), body, "g"))
    assert b"event: error" in failed[0] and b"engine gone" in failed[0]


def test_gyre_fields_ride_along() -> None:
    chat = to_chat({"input": "x", "execution_id": "e1", "agent_id": "main", "return_token_ids": True, "top_k": 5})
    assert (chat["execution_id"], chat["agent_id"], chat["return_token_ids"], chat["top_k"]) == ("e1", "main", True, 5)
