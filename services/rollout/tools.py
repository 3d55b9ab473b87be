"""Tool calling on the OpenAI endpoint: tool specs, ``tool_choice``, per-family call formats.

A request's ``tools`` reach the model through its chat template: ``apply_chat_template(tools=...)``
when the template renders tools itself (its source mentions ``tools``), else the **fallback**: a
system block (merged into the first system message, or put first) that lists the tools as JSON
and asks for calls in the format's syntax. The format (``tool_parser``: ``auto`` picks by the
template) says how calls look in generated text and parses them back:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before
  the first one is the message content (Qwen, Hermes, SmolLM-style models; the fallback's);
* ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``.

``tool_choice``: ``auto`` parses calls out of free generation; ``none`` returns text (tools are
still rendered, so prompts of one conversation stay one prefix); ``required`` and a named function
force the reply to open a call: the format's opening (``<tool_call>\\n{"name": "`` or, named, up to
``"arguments": ``) is appended to the prompt, so those forced tokens are context the model did
not choose and are never trained on; the model writes the rest under a grammar
(``forced_grammar``: one of the tools' names, arguments valid against that tool's JSON schema, the
format's closing text), so the arguments always parse and match the schema.

Exact prefixes across turns: the raw text a tool-call reply was generated as is kept per tool call
id, and the next request's assistant message carrying those ids is rendered as that text (not
re-serialized), so the conversation extends the recorded token ids and stays one trajectory path.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidArgument
from services.rollout.chat import content_text

if TYPE_CHECKING:
    from services.rollout.grammar import GrammarSpec

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text as generated (OpenAI: "may not be valid JSON")
    id: str = ""


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # auto | none | required | named
    name: str = ""  # the forced function (named)


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` as function specs ``{"name", "description", "parameters"}``."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidArgument("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise InvalidArgument(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidArgument(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema object")
        if any(o["name"] == name for o in out):
            raise InvalidArgument(f"two tools are named {name!r}")
        out.append({"name": name, "description": str(fn.get("description") or ""), "parameters": params})
    return out


def parse_tool_choice(choice: Any, tools: Sequence[dict[str, Any]]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidArgument(f"tool_choice is {choice!r}; expected auto, none, required or a function")
        if choice != "none" and not tools:
            raise InvalidArgument(f"tool_choice {choice!r} needs 'tools'")
        if choice == "required" and len(tools) == 1:
            return ToolChoice("named", tools[0]["name"])  # the only tool: force it by name
        return ToolChoice(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise InvalidArgument("tool_choice must be auto, none, required or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}")
    if name not in {t["name"] for t in tools}:
        raise InvalidArgument(f"tool_choice names {name!r}, which is not in 'tools'")
    return ToolChoice("named", name)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _forced_grammar(choice: ToolChoice, tools: Sequence[dict[str, Any]], name_tail: str,
                    close: str) -> GrammarSpec | None:
    """The grammar of the rest of a forced call after ``forced_prefix``: named, the arguments and
    ``close``; required, one tool's name, ``name_tail``, its arguments and ``close``."""
    if choice.mode not in ("named", "required"):
        return None
    from services.rollout.grammar import GrammarSpec

    named = [t for t in tools if t["name"] == choice.name] if choice.mode == "named" else list(tools)
    # key order kept: a schema's "properties" order is the order the grammar makes the arguments
    # take (the tool's declared order, which the prompt shows the model); sorted keys would force
    # {"code", "module"} on a tool declared {"module", "code"}
    specs = json.dumps([[t["name"], t.get("parameters") or {"type": "object"}] for t in named])
    try:
        return GrammarSpec("ebnf", _forced_ebnf(specs, choice.mode == "named", name_tail, close))
    except Exception as exc:  # deliberate: xgrammar's schema converter raises several error types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidArgument(f"a tool's 'parameters' is not a JSON schema the gateway can enforce: {first}") from None


@functools.lru_cache(maxsize=256)
def _forced_ebnf(specs: str, named: bool, name_tail: str, close: str) -> str:
    """EBNF of ``_forced_grammar`` from its tools' ``[name, schema]`` (as JSON: a harness sends the
    same tools every turn, so each set is converted once)."""
    from services.rollout.grammar import tool_call_ebnf, union_ebnf

    tools = json.loads(specs)
    if named:
        return tool_call_ebnf("", tools[0][1], close)
    return union_ebnf([tool_call_ebnf(name + name_tail, schema, close) for name, schema in tools])


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def forced_prefix(self, choice: ToolChoice) -> str:
        if choice.mode == "named":
            return f'{self.OPEN}\n{{"name": "{choice.name}", "arguments": '
        return f'{self.OPEN}\n{{"name": "' if choice.mode == "required" else ""

    def forced_grammar(self, choice: ToolChoice, tools: Sequence[dict[str, Any]]) -> GrammarSpec | None:
        return _forced_grammar(choice, tools, '", "arguments": ', f"}}\n{self.CLOSE}")

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return ("You can call functions. Their signatures, one JSON object per line:\n<tools>\n" + listed +
                "\n</tools>\nTo call one, reply with a JSON object of its name and arguments between tags:\n"
                f'{self.OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{self.CLOSE}')

    def render_call(self, call: ToolCall) -> str:
        return f'{self.OPEN}\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n{self.CLOSE}'

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.OPEN)
        if start < 0:
            return text, []
        calls = []
        at = start
        while (i := text.find(self.OPEN, at)) >= 0:
            # A whole JSON object first: the closing tag written inside one of its strings (a file's
            # text, say) is text, not the call's end. Only an unfinished or malformed object is cut
            # at the first closing tag (or the end), as max_tokens left it.
            try:
                obj, end = _JSON.raw_decode(text, _skip_space(text, i + len(self.OPEN)))
            except json.JSONDecodeError:
                m = self._CALL.match(text, i)  # always matches: up to the closing tag or the end
                assert m is not None
                call, at = _call_from_json(m.group(1), ("arguments", "parameters")), m.end()
            else:
                call = _call_from_obj(obj, ("arguments", "parameters"))
                after = _skip_space(text, end)
                at = after + len(self.CLOSE) if text.startswith(self.CLOSE, after) else end
            if call is None:
                return text, []  # not a well-formed call: the reply is text
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls

    def holdback(self, text: str) -> int:
        """Where streamed content must stop: at a (possibly partial) opening tag."""
        i = text.find(self.OPEN)
        if i >= 0:
            return i
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonFormat:
    """The whole reply is ``{"name": ..., "parameters": {...}}`` (Llama 3.x JSON tool calling)."""

    name = "llama3_json"

    def forced_prefix(self, choice: ToolChoice) -> str:
        if choice.mode == "named":
            return f'{{"name": "{choice.name}", "parameters": '
        return '{"name": "' if choice.mode == "required" else ""

    def forced_grammar(self, choice: ToolChoice, tools: Sequence[dict[str, Any]]) -> GrammarSpec | None:
        return _forced_grammar(choice, tools, '", "parameters": ', "}")

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        return ("You can call functions. Their signatures, one JSON object per line:\n" + listed +
                '\nTo call one, reply with only {"name": "<function name>", "parameters": {<arguments>}}.')

    def render_call(self, call: ToolCall) -> str:
        return f'{{"name": "{call.name}", "parameters": {call.arguments}}}'

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_top_level(body, ";"):
            call = _call_from_json(part, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
        return None, calls

    def holdback(self, text: str) -> int:
        return 0 if text.lstrip().startswith(("{", "<|python_tag|>")) or not text.strip() else len(text)


FORMATS: dict[str, type[HermesFormat] | type[Llama3JsonFormat]] = {"hermes": HermesFormat,
                                                                   "llama3_json": Llama3JsonFormat}


def format_for(template: str, setting: str = "auto") -> HermesFormat | Llama3JsonFormat:
    """The call format of a chat template (``setting`` overrides ``auto``)."""
    if setting != "auto":
        if setting not in FORMATS:
            raise ValueError(f"tool_parser {setting!r}; expected auto, {', '.join(FORMATS)}")
        return FORMATS[setting]()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonFormat()
    return HermesFormat()


def template_renders_tools(template: str) -> bool:
    return "tools" in template


_JSON = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def _skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()  # type: ignore[union-attr]  # \s* matches everywhere


def _call_from_json(text: str, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from its JSON text; a truncated object (max_tokens) keeps its arguments as text."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        m = re.match(r'\s*\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*?)\s*\}?\s*$',
                     text, re.DOTALL)
        return ToolCall(m.group(1), m.group(2)) if m else None
    return _call_from_obj(obj, arg_keys)


def _call_from_obj(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in arg_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


class RawReplies:
    """Tool call id -> the exact text its reply was generated as (bounded LRU). Thread-safe."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._raw: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, call_ids: Sequence[str], raw: str) -> None:
        with self._lock:
            for cid in call_ids:
                self._raw[cid] = raw
                self._raw.move_to_end(cid)
            while len(self._raw) > self.max_entries:
                self._raw.popitem(last=False)

    def get(self, call_id: str) -> str | None:
        with self._lock:
            return self._raw.get(call_id)


def prepare_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], fmt: Any,
                     raw: RawReplies, *, template_tools: bool) -> list[dict[str, Any]]:
    """Messages as the template renders them: assistant tool calls as their raw generated text
    (or, unknown here, in the format's syntax), tool results as role "tool", the fallback's
    tool instructions in the system message. Checks tool names (but for calls this gateway
    returned) and call ids."""
    names = {t["name"] for t in tools}
    open_ids: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise InvalidArgument(f"messages[{i}].tool_calls must be a list")
            parsed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
                    raise InvalidArgument(f"messages[{i}].tool_calls[{j}] must have an id and function.name")
                # a call to a tool the request does not declare is bad input, unless this gateway
                # returned it: the model wrote it, the client sends it back with its answer (Claude
                # Code: "No such tool available"), and the conversation stays one recorded path
                if tools and fn["name"] not in names and raw.get(c["id"]) is None:
                    raise InvalidArgument(f"messages[{i}] calls tool {fn['name']!r}, which is not in 'tools'")
                parsed.append(ToolCall(fn["name"], str(fn.get("arguments") or "{}"), c["id"]))
                open_ids.add(c["id"])
            text = raw.get(parsed[0].id)
            if text is None or any(raw.get(c.id) != text for c in parsed):
                content = content_text(m)
                text = (content + "\n" if content else "") + "\n".join(fmt.render_call(c) for c in parsed)
            out.append({"role": "assistant", "content": text})
            continue
        if role == "tool" and m.get("tool_call_id") is not None:
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in open_ids:
                raise InvalidArgument(f"messages[{i}] answers tool_call_id {cid!r}, which no earlier assistant "
                                      "message called")
            out.append({"role": "tool", "content": content_text(m), "tool_call_id": cid})
            continue  # (a tool message without an id is a plain observation turn, rendered as is)
        out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if tools and not template_tools:
        block = fmt.instructions(tools)
        if out and out[0].get("role") == "system":
            first = dict(out[0])
            first["content"] = f"{content_text(first)}\n\n{block}".lstrip()
            out[0] = first
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
