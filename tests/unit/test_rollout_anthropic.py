"""The Messages API translation: requests to chat calls, replies and streams back to Messages."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.rollout.anthropic_http import from_chat, stream_from_chat, to_chat


def test_a_messages_request_becomes_the_equivalent_chat_call() -> None:
    chat = to_chat({"model": "gyre", "max_tokens": 9, "system": [{"type": "text", "text": "be brief"}],
                    "stop_sequences": ["\n\nHuman:"], "tool_choice": {"type": "any"},
                    "tools": [{"name": "run_tests", "input_schema": {"type": "object"}}],
                    "messages": [{"role": "user", "content": "go"},
                                 {"role": "assistant", "content": [
                                     {"type": "text", "text": "ok"},
                                     {"type": "tool_use", "id": "t1", "name": "run_tests", "input": {"m": 1}}]},
                                 {"role": "user", "content": [
                                     {"type": "tool_result", "tool_use_id": "t1", "content": "pass"},
                                     {"type": "text", "text": "next"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "run_tests", "arguments": '{"m": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "pass"}, {"role": "user", "content": "next"}]
    assert chat["tool_choice"] == "required" and chat["stop"] == ["\n\nHuman:"] and chat["max_tokens"] == 9
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    for bad, why in [({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                     ({"max_tokens": 1, "messages": []}, "messages"),
                     ({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "role"),
                     ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                       "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools only"),
                     ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
                     ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "x"}},
                      "tool_choice")]:
        with pytest.raises(InvalidArgument, match=why):
            to_chat(bad)


def test_claude_code_shaped_requests_translate() -> None:
    """What Claude Code sends: a system message mid-list (its environment block), cache_control
    marks, thinking / context-management / effort fields and echoed thinking blocks."""
    chat = to_chat({"model": "gyre", "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
                    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                 {"role": "system", "content": [{"type": "text", "text": "# Environment",
                                                                 "cache_control": {"type": "ephemeral"}}]},
                                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "...",
                                                                    "signature": "s"}, {"type": "text", "text": "hello"}]},
                                 {"role": "user", "content": "list files"}]})
    assert chat["messages"] == [{"role": "system", "content": "You are Claude Code."}, {"role": "user", "content": "hi"},
                                {"role": "system", "content": "# Environment"},
                                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "list files"}]
    assert chat["max_tokens"] == 32000 and chat["stream"] is True


def test_replies_and_streams_come_back_as_messages() -> None:
    resp = {"id": "chatcmpl-abc", "choices": [{"finish_reason": "tool_calls", "message": {
        "content": "checking", "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": '{"a": 2}'}},
                                              {"id": "call_2", "function": {"name": "g", "arguments": "{oops"}}]}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    msg = from_chat(resp, "gyre")
    assert msg["id"] == "msg_abc" and msg["stop_reason"] == "tool_use"
    assert msg["content"] == [{"type": "text", "text": "checking"},
                              {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 2}},
                              {"type": "tool_use", "id": "call_2", "name": "g", "input": {"_unparsed_arguments": "{oops"}}]
    assert msg["usage"] == {"input_tokens": 7, "output_tokens": 3}
    # prompt tokens an engine took from its prefix cache count as the Messages API's cache reads
    cached = from_chat({**resp, "usage": {**resp["usage"], "prompt_tokens_details": {"cached_tokens": 5}}}, "m")
    assert cached["usage"] == {"input_tokens": 2, "output_tokens": 3, "cache_read_input_tokens": 5}

    def sse(obj: object) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    chunks = [sse({"id": "chatcmpl-x", "choices": [{"delta": {"role": "assistant", "content": ""}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {"content": "hi"}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {"tool_calls": [
                  {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]}}]}),
              sse({"id": "chatcmpl-x", "choices": [{"delta": {}, "finish_reason": "tool_calls"}],
                   "usage": {"completion_tokens": 4}}), b"data: [DONE]\n\n"]
    events = [e.decode().split("\n")[0].removeprefix("event: ") for e in stream_from_chat(iter(chunks), "gyre")]
    assert events == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                      "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                      "message_stop"]
