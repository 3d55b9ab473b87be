"""Anthropic Messages API on the gateway's HTTP endpoint: ``POST /v1/messages`` (and under a
session base URL, ``/s/<token>/v1/messages``).

A request is translated into the chat-completions call the OpenAI endpoint serves, so it is
rendered, routed, recorded (TITO) and reused across turns exactly the same way:

    system (string or text blocks)          -> a system message
    system messages in the list (Claude Code's environment block) -> system messages in place
    user text blocks / tool_result blocks   -> a user message / tool messages (tool_call_id = tool_use_id)
    assistant text / tool_use blocks        -> content / tool_calls (arguments = the input as JSON)
    tools [{name, description, input_schema}], tool_choice auto|any|tool|none, stop_sequences
    thinking / redacted_thinking blocks, ``thinking``, ``context_management``, ``output_config``,
    ``metadata``, ``cache_control``   -> accepted and passed over (the served models do not think;
                                         the engines' prefix cache needs no hints)

The reply comes back as content blocks (``text``, ``tool_use`` with its ``input`` object),
``stop_reason`` end_turn | max_tokens | stop_sequence | tool_use and ``usage``; with ``stream`` as
the Messages event stream (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors use the API's own shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from services.common.errors import InvalidArgument
from services.rollout.chat import chat_events, text_parts

# Gyre's own body fields (the call's identity, token ids in the reply; see openai_http.py)
GYRE_FIELDS = ("execution_id", "agent_id", "role", "call_id", "job_id", "attempt", "return_token_ids",
               "stop_token_ids")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               410: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as the chat-completions body the OpenAI endpoint serves."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgument("max_tokens: a positive integer is required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: a non-empty list is required")
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": text_parts(body["system"], "system")})
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "system":  # mid-conversation system context, as Claude Code sends its environment
            out.append({"role": "system", "content": text_parts(m.get("content") or "", f"messages.{i}.content")})
            continue
        if role not in ("user", "assistant"):
            raise InvalidArgument(f"messages.{i}.role must be user, assistant or system")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InvalidArgument(f"messages.{i}.content must be a string or a list of blocks")
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise InvalidArgument(f"messages.{i}.content.{j}: tool_use needs an id and a name")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # a client echoing its reasoning back: the served models write none to extend
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": text_parts(result, f"messages.{i}.content.{j}.content") if result else ""})
            else:
                raise InvalidArgument(f"messages.{i}.content.{j}: block type {kind!r} is not supported in a "
                                      f"{role} message")
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})})
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    chat: dict[str, Any] = {"messages": out, "max_tokens": max_tokens, "stream": bool(body.get("stream"))}
    for k in ("temperature", "top_p", "top_k", "model", *GYRE_FIELDS):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidArgument("tools must be a list of {name, description, input_schema}")
        for n, t in enumerate(tools):
            if t.get("type") not in (None, "custom"):  # server tools (web search, code execution...)
                raise InvalidArgument(f"tools.{n}: tool type {t.get('type')!r} is not supported (client tools only)")
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                            "parameters": t.get("input_schema") or {"type": "object"}}}
                         for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif mapped:
            chat["tool_choice"] = mapped
        else:
            raise InvalidArgument("tool_choice must be {type: auto|any|tool|none}")
    return chat


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_unparsed_arguments": arguments}  # the model wrote invalid JSON: kept, not dropped
    return value if isinstance(value, dict) else {"_arguments": value}


STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def from_chat(resp: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat-completions response as a Messages response."""
    choice = resp["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": _input(c["function"]["arguments"])})
    usage = resp.get("usage") or {}
    return {"id": "msg_" + resp["id"].split("-", 1)[-1], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": STOP.get(choice.get("finish_reason") or "stop", "end_turn"),
            "stop_sequence": None,
            "usage": _usage(usage), "gyre": resp.get("gyre")}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Messages usage: as the Messages API counts, ``input_tokens`` leaves out the prompt tokens read
    from the (engine's prefix) cache, which ``cache_read_input_tokens`` gives."""
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    out = {"input_tokens": usage.get("prompt_tokens", 0) - cached, "output_tokens": usage.get("completion_tokens", 0)}
    return {**out, "cache_read_input_tokens": cached} if cached else out


def stream_from_chat(chunks: Iterator[bytes], model: str) -> Iterator[bytes]:
    """The chat-completions SSE stream as the Messages event stream."""
    def event(kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    index, text_open, started, reason = -1, False, False, "end_turn"
    usage: dict[str, Any] = {}
    gyre: Any = None
    for ev in chat_events(chunks):
        if "error" in ev:
            yield event("error", {"error": {"type": "api_error", "message": ev["error"].get("message", "")}})
            return
        if not started:
            started = True
            yield event("message_start", {"message": {
                "id": "msg_" + str(ev.get("id", "")).split("-", 1)[-1], "type": "message", "role": "assistant",
                "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}})
        usage = ev.get("usage") or usage
        gyre = ev.get("gyre") or gyre
        for ch in ev.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("content"):
                if not text_open:
                    index += 1
                    text_open = True
                    yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield event("content_block_delta", {"index": index,
                                                    "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                if text_open:
                    yield event("content_block_stop", {"index": index})
                    text_open = False
                index += 1
                yield event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(_input(call["function"]["arguments"]))}})
                yield event("content_block_stop", {"index": index})
            if ch.get("finish_reason"):
                reason = STOP.get(ch["finish_reason"], "end_turn")
    if text_open:
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": None},
                                  "usage": {"output_tokens": usage.get("completion_tokens", 0)}, "gyre": gyre})
    yield event("message_stop", {})
