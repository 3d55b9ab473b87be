"""OpenAI Responses API on the gateway's HTTP endpoint: ``POST /v1/responses`` (and under a session
base URL, ``/s/<token>/v1/responses``), the API Codex and the OpenAI Agents SDK speak.

A request is translated into the chat-completions call the OpenAI endpoint serves, so it is
rendered, routed, recorded (TITO) and reused across turns exactly like a chat call:

    instructions                                  -> a system message (first)
    message items (role system | developer | user | assistant; content a string or
      input_text / output_text parts)             -> messages (developer is a system message)
    function_call items (call_id, name, arguments) -> an assistant message's tool_calls (consecutive
                                                      calls: one assistant turn)
    function_call_output items (call_id, output)  -> tool messages
    reasoning items                               -> passed over: accepted, not rendered (the served
                                                      models write no reasoning items)
    tools [{type: function, name, description, parameters}], tool_choice auto | none | required |
      {type: function, name}, max_output_tokens, temperature, top_p, stream
    text.format {type: text | json_object | json_schema, name, schema, strict}
                                                  -> response_format (enforced by the engine's grammar)

The reply is a ``response`` object: ``output`` holds a ``message`` item (``output_text``) and/or
``function_call`` items, ``status`` completed (or incomplete with ``incomplete_details.reason``
max_output_tokens), ``usage`` with ``input_tokens_details.cached_tokens`` (prompt tokens an engine
took from its prefix cache). With ``stream`` it is the Responses event stream (response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.function_call_arguments.delta / .done,
response.output_item.done, response.completed; each with a ``sequence_number``).

Tools: function tools; a ``namespace`` tool (Codex's grouped tools) is offered as its member
functions; hosted tools (``web_search``, ``file_search``, ``code_interpreter``...: run by OpenAI's
servers, not the client) are accepted and not offered to the model (Codex sends ``web_search``
with ``external_web_access: false``). Not served, with a 400 naming it: ``previous_response_id``
(the gateway keeps no responses: send the whole input, as ``store: false`` clients do),
``background``, other tool types, image / file / audio input parts, ``n`` > 1 style fan-out. A
``function_call_output`` whose ``call_id`` no ``function_call`` of the input made, and an item of
an unknown type, are 400s too; nothing is recorded for a refused request.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from services.common.errors import InvalidArgument
from services.rollout.chat import chat_events

# Gyre's own body fields (the call's identity, token ids in the reply; see openai_http.py)
GYRE_FIELDS = ("execution_id", "agent_id", "role", "call_id", "job_id", "attempt", "return_token_ids", "top_k",
               "stop_token_ids")
UNSUPPORTED = {
    "previous_response_id": "previous_response_id is not supported: this gateway keeps no responses; send the "
                            "whole conversation as input (store: false)",
    "background": "background responses are not supported",
    "conversation": "conversation objects are not supported: send the whole conversation as input",
    "prompt": "prompt templates are not supported: send instructions and input",
}


def _text(content: Any, where: str) -> str:
    """A message item's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content must be a string or a list of content parts")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{where}.content.{k}.text must be a string")
            out.append(part["text"])
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        else:
            raise InvalidArgument(f"{where}.content.{k}: content part type {kind!r} is not supported "
                                  "(text parts only: input_text, output_text)")
    return "".join(out)


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text(output, where)
    raise InvalidArgument(f"{where}.output must be a string or a list of text parts")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat-completions body the OpenAI endpoint serves."""
    for key, why in UNSUPPORTED.items():
        if body.get(key):
            raise InvalidArgument(why)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidArgument("instructions must be a string")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input: a string or a non-empty list of items is required")
    called: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidArgument(f"{where}.role must be user, assistant, system or developer")
            text = _text(item.get("content"), where)
            role = "system" if role == "developer" else role
            if role == "assistant" and messages and messages[-1]["role"] == "assistant" \
                    and not messages[-1].get("content") and messages[-1].get("tool_calls"):
                messages[-1]["content"] = text  # (text and calls of one turn, in either order)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise InvalidArgument(f"{where}: a function_call needs a call_id and a name")
            if not isinstance(arguments, str):
                raise InvalidArgument(f"{where}.arguments must be a string (JSON text)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's text or other calls
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            called.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise InvalidArgument(f"{where}: function_call_output for call_id {call_id!r}, which no "
                                      "function_call earlier in the input made")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _output_text(item.get("output", ""), where)})
        elif kind == "reasoning":
            continue  # passed over: the served models write no reasoning items
        else:
            raise InvalidArgument(f"{where}: item type {kind!r} is not supported (message, function_call, "
                                  "function_call_output, reasoning)")
    if not any(m["role"] != "system" for m in messages):
        raise InvalidArgument("input holds no message to answer (only instructions or system messages)")
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    max_out = body.get("max_output_tokens")
    if max_out is not None:
        if isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1:
            raise InvalidArgument("max_output_tokens must be a positive integer")
        chat["max_tokens"] = max_out
    for key in ("temperature", "top_p", "model", "seed", *GYRE_FIELDS):
        if body.get(key) is not None:
            chat[key] = body[key]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise InvalidArgument("tools must be a list of function tools")
        chat_tools: list[dict[str, Any]] = []
        for k, t in enumerate(tools):
            chat_tools += _function_tools(t, f"tools[{k}]")
        if chat_tools:
            chat["tools"] = chat_tools
    choice = body.get("tool_choice")
    if choice is not None:
        if choice in ("auto", "none", "required"):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise InvalidArgument("tool_choice must be auto, none, required or {type: function, name}")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:  # Responses' flat {type: json_schema, name, schema, strict} -> chat's response_format
        if not isinstance(fmt, dict):
            raise InvalidArgument("text.format must be {type: text | json_object | json_schema, ...}")
        kind = fmt.get("type")
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise InvalidArgument("text.format json_schema needs a 'schema' object (a JSON schema)")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", ""), "schema": fmt["schema"], "strict": fmt.get("strict", False)}}
        elif kind in ("text", "json_object"):
            chat["response_format"] = {"type": kind}
        else:
            raise InvalidArgument(f"text.format type must be text, json_object or json_schema, got {kind!r}")
    return chat


HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "mcp", "local_shell")


def _function_tools(t: Any, where: str) -> list[dict[str, Any]]:
    """A Responses tool as chat function tools: a function tool as itself, a namespace (Codex's
    grouped tools) as its member functions, a hosted tool (web search...: run by OpenAI's servers,
    not by the client) as none (the model is not offered it)."""
    kind = t.get("type") if isinstance(t, dict) else None
    if kind in HOSTED_TOOLS:
        return []
    if kind == "namespace":
        members = t.get("tools")
        if not isinstance(members, list):
            raise InvalidArgument(f"{where}: a namespace tool needs a list of tools")
        return [f for j, m in enumerate(members) for f in _function_tools(m, f"{where}.tools[{j}]")]
    if kind != "function":
        raise InvalidArgument(f"{where}: tool type {kind!r} is not supported (function tools, namespaces of them, "
                              "and hosted tools, which are not offered)")
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise InvalidArgument(f"{where}: a function tool needs a name")
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}]


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, out = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + out}


def _envelope(body: dict[str, Any], rid: str, created: int, model: str) -> dict[str, Any]:
    """The request's echo fields of a response object."""
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "output": [], "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": None}


def _finish(resp: dict[str, Any], reason: str | None) -> None:
    if reason == "length":
        resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def from_chat(resp: dict[str, Any], body: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat-completions response as a Responses ``response`` object."""
    choice = resp["choices"][0]
    msg = choice["message"]
    out = _envelope(body, "resp_" + resp["id"].split("-", 1)[-1], int(resp.get("created", time.time())), model)
    if msg.get("content"):
        out["output"].append(_message_item(msg["content"]))
    out["output"] += [_call_item(c) for c in msg.get("tool_calls") or []]
    _finish(out, choice.get("finish_reason"))
    out["usage"] = _usage(resp.get("usage") or {})
    out["gyre"] = resp.get("gyre")
    return out


def stream_from_chat(chunks: Iterator[bytes], body: dict[str, Any], model: str) -> Iterator[bytes]:
    """The chat-completions SSE stream as the Responses event stream."""
    seq = 0

    def event(kind: str, data: dict[str, Any]) -> bytes:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    resp: dict[str, Any] | None = None
    text_item: dict[str, Any] | None = None
    text, reason, gyre = "", None, None
    usage: dict[str, Any] = {}
    for ev in chat_events(chunks):
        if "error" in ev:
            err = ev["error"]
            yield event("error", {"code": err.get("code") or "server_error", "message": err.get("message", ""),
                                  "param": None})
            return
        if resp is None:
            resp = _envelope(body, "resp_" + str(ev.get("id", uuid.uuid4().hex)).split("-", 1)[-1],
                             int(ev.get("created", time.time())), model)
            yield event("response.created", {"response": resp})
            yield event("response.in_progress", {"response": resp})
        usage = ev.get("usage") or usage
        gyre = ev.get("gyre") or gyre
        for ch in ev.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("content"):
                if text_item is None:
                    text_item = _message_item("", status="in_progress")
                    text_item["content"] = []
                    resp["output"].append(text_item)
                    index = len(resp["output"]) - 1
                    yield event("response.output_item.added", {"output_index": index, "item": text_item})
                    yield event("response.content_part.added", {
                        "item_id": text_item["id"], "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})
                text += delta["content"]
                yield event("response.output_text.delta", {"item_id": text_item["id"],
                                                           "output_index": resp["output"].index(text_item),
                                                           "content_index": 0, "delta": delta["content"]})
            calls = delta.get("tool_calls") or []
            if calls and text_item is not None and text_item["status"] == "in_progress":
                yield from _close_text(event, resp, text_item, text)
            for call in calls:
                item = _call_item(call, status="in_progress")
                args = item["arguments"]
                item["arguments"] = ""
                resp["output"].append(item)
                index = len(resp["output"]) - 1
                yield event("response.output_item.added", {"output_index": index, "item": dict(item)})
                yield event("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                       "delta": args})
                yield event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                      "arguments": args})
                item["arguments"], item["status"] = args, "completed"
                yield event("response.output_item.done", {"output_index": index, "item": item})
            if ch.get("finish_reason"):
                reason = ch["finish_reason"]
    if resp is None:  # the chat stream ended before its first chunk
        yield event("error", {"code": "server_error", "message": "the model call ended without output",
                              "param": None})
        return
    if text_item is not None and text_item["status"] == "in_progress":
        yield from _close_text(event, resp, text_item, text)
    _finish(resp, reason)
    resp["usage"] = _usage(usage)
    resp["gyre"] = gyre
    yield event("response.completed" if resp["status"] == "completed" else "response.incomplete", {"response": resp})


def _close_text(event: Any, resp: dict[str, Any], item: dict[str, Any], text: str) -> Iterator[bytes]:
    index = resp["output"].index(item)
    part = {"type": "output_text", "text": text, "annotations": []}
    yield event("response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                              "text": text})
    yield event("response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                               "part": part})
    item["content"], item["status"] = [part], "completed"
    yield event("response.output_item.done", {"output_index": index, "item": item})
