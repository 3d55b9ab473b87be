"""The gateway's OpenAI-compatible API, as a translation to gateway calls: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, Anthropic's ``/v1/messages`` (``anthropic_http.py``) and
OpenAI's ``/v1/responses`` (``responses_http.py``). The HTTP server that serves these routes
(connections, TLS, auth, SSE, error statuses) is ``http_server.py``.

Each request becomes one gateway call, so it is routed, migrated and recorded (TITO) exactly like
a gRPC call. The prompt ids come from ``chat.PromptCache``: the chat template is rendered once and
the exact ids of earlier turns are reused when the messages extend an earlier conversation.

Gyre fields ride in headers or in the body (the ``openai`` client's ``extra_body``):
``x-gyre-execution-id`` / ``execution_id``, ``x-gyre-agent-id`` / ``agent_id``, ``x-gyre-role`` /
``role`` (main | subagent | summary), ``x-gyre-call-id`` / ``call_id``, ``x-gyre-job-id`` /
``job_id``, ``x-gyre-attempt`` / ``attempt`` (the lease's attempt: a re-leased execution's records
replace the earlier attempt's); ``top_k`` and ``return_token_ids`` (adds ``gyre.prompt_ids``/``gyre.output_ids``).
Tool calling: ``tools`` and ``tool_choice`` (auto, none, required, a named function) through the
chat template or its fallback, calls parsed back per model family and returned as ``tool_calls``
(streamed as ``tool_calls`` deltas), ``finish_reason: tool_calls``; see ``services/rollout/tools.py``.
Structured outputs: ``response_format`` ``json_object`` / ``json_schema`` (and a forced tool call's
arguments) are enforced by the engine's grammar (``services/rollout/grammar.py``, xgrammar).

Session base URLs: ``/s/<token>/v1/...`` (the token from a lease's ``session_base_url`` or
``Harnesses.MintSession``) serves the same routes for a harness that knows only a base URL: the
session says the job, execution, agent, role and attempt, and those win over any header; a call
through it that sends no ``temperature`` samples at the execution's (0 for a greedy evaluation:
Claude Code, for one, sends none), otherwise at 1.
Errors are OpenAI-style JSON: 400 bad input, 401 bad bearer token, 404 unknown route/model/session,
410 a session whose execution ended or was leased again, 413 too large, 503 no engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.common.logging import get_logger
from services.rollout.calls import CallMeta, Piece
from services.rollout.chat import PromptCache, Rendered
from services.rollout.engine import SamplingParams
from services.rollout.grammar import GrammarSpec
from services.rollout import anthropic_http as anthropic
from services.rollout import responses_http as responses_api
from services.rollout import tools as tools_mod
from services.rollout.gateway import Gateway

log = get_logger(__name__)


class OpenAIEndpoint:
    """The request logic (no sockets): body + headers -> response JSON or SSE events."""

    def __init__(self, gateway: Gateway, *, tokenizer: Any, model_name: str, job_id: str = "",
                 default_max_tokens: int = 256, prompt_cache_tokens: int = 8_000_000, sessions: Any = None,
                 tool_parser: str = "auto", new_call_id: Callable[[], str] = tools_mod.new_call_id) -> None:
        self.gateway = gateway
        self.sessions = sessions  # services.scheduler.sessions.Sessions (None: no session URLs)
        template = str(getattr(tokenizer, "chat_template", "") or "")
        self.tool_format = tools_mod.format_for(template, tool_parser)
        self.template_tools = tools_mod.template_renders_tools(template)
        self.raw_replies = tools_mod.RawReplies()
        self.new_call_id = new_call_id  # ids of the tool calls in replies
        self._misses: OrderedDict[tuple[str, str], None] = OrderedDict()  # sessions that missed the prompt cache
        self._misses_lock = threading.Lock()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.job_id = job_id
        self.default_max_tokens = default_max_tokens
        self.prompts = PromptCache(tokenizer, max_tokens=prompt_cache_tokens)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.default_stop_ids: tuple[int, ...] = (int(eos),) if eos is not None else ()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "gyre"}]}

    def session_headers(self, token: str, headers: Any) -> dict[str, str]:
        """The Gyre fields of a session URL's call (the session's, over any the client sent)."""
        if self.sessions is None:
            raise NotFound("this gateway serves no session URLs (it was started without the scheduler's Redis)")
        try:
            s = self.sessions.resolve(token)
            ended = self.sessions.ended_reason(s) if s is not None else ""
        except Exception as exc:  # deliberate: Redis unreachable is the client's 503, not a crash
            raise Unavailable(f"session lookup failed: {exc}") from None
        if s is None:
            raise NotFound("unknown or expired session; use the session_base_url of a current lease")
        if ended:
            raise SessionEnded(ended)
        out = {"x-gyre-job-id": s.job_id, "x-gyre-execution-id": s.execution_id, "x-gyre-agent-id": s.agent_id,
               "x-gyre-role": s.role, "x-gyre-attempt": str(s.attempt)}
        if s.temperature is not None:  # what a call that sends no temperature samples at
            out[SESSION_TEMPERATURE] = repr(s.temperature)
        call_id = headers.get("x-gyre-call-id")
        if call_id:
            out["x-gyre-call-id"] = call_id
        return out

    # -- request parsing ---------------------------------------------------------------------
    def _meta(self, body: dict[str, Any], headers: Any) -> CallMeta:
        def field(name: str) -> str:
            value = headers.get(f"x-gyre-{name.replace('_', '-')}") or body.get(name) or ""
            if not isinstance(value, str):
                raise InvalidArgument(f"{name} must be a string")
            return value

        attempt = headers.get("x-gyre-attempt") or body.get("attempt") or 0
        if isinstance(attempt, bool) or not (isinstance(attempt, int) and attempt >= 0
                                             or isinstance(attempt, str) and attempt.isdigit()):
            raise InvalidArgument(f"attempt must be a non-negative integer (the lease's attempt), got {attempt!r}")
        return CallMeta(job_id=field("job_id") or self.job_id, execution_id=field("execution_id"),
                        call_id=field("call_id") or uuid.uuid4().hex, agent_id=field("agent_id"),
                        role=field("role") or "main", attempt=int(attempt))

    def _params(self, body: dict[str, Any], headers: Any = None) -> SamplingParams:
        if body.get("model") not in (None, "", self.model_name):
            raise NotFound(f"model {body.get('model')!r} does not exist; this gateway serves {self.model_name!r}")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        stop_ids = list(self.default_stop_ids) + [int(t) for t in body.get("stop_token_ids") or []]
        stop_ids += self._stops(body)[0]
        seed = body.get("seed")
        try:
            default = (headers or {}).get(SESSION_TEMPERATURE) or 1.0  # a session's, set by session_headers alone
            temperature = body.get("temperature")
            return SamplingParams(temperature=float(default if temperature is None else temperature),
                                  top_p=float(body.get("top_p", 1.0) or 1.0), top_k=int(body.get("top_k", 0) or 0),
                                  max_new_tokens=int(max_tokens), stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                                  seed=None if seed is None else int(seed), top_logprobs=_top_n(body),
                                  grammar=response_grammar(body.get("response_format")))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"invalid sampling parameters: {exc}") from None

    def _stops(self, body: dict[str, Any]) -> tuple[list[int], list[str]]:
        """``stop``: single-token strings become stop ids (the engine stops on them); longer ones
        are matched in the text (``_watch_stops``)."""
        stop = body.get("stop")
        if not stop:
            return [], []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 16 or not all(isinstance(s, str) and 0 < len(s) <= 256
                                                                     for s in stops):
            raise InvalidArgument("'stop' must be a string or a list of at most 16 strings of 1-256 characters")
        ids, texts = [], []
        for s in stops:
            enc = self.tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(enc) == 1:
                ids.append(int(enc[0]))
            else:
                texts.append(s)
        return ids, texts

    def _watch_stops(self, call: Any, pieces: Iterator[Piece], stops: list[str]) -> Iterator[Piece]:
        """Pass ``pieces`` on; once the output text holds a stop string, end the call there: the
        returned text stops before it and the recorded output is cut to the tokens before it."""
        for piece in pieces:
            yield piece
            ids, _ = call.output()
            text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits and call.stop_at is None:
                call.stop_at = self._tokens_within(ids, min(hits))

    def _tokens_within(self, ids: np.ndarray, chars: int) -> int:
        """The most leading tokens of ``ids`` whose text is at most ``chars`` characters."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.tokenizer.decode(ids[:mid].tolist(), skip_special_tokens=False)) <= chars:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- calls -------------------------------------------------------------------------------
    def _missed(self, session: tuple[str, str]) -> bool:
        """Whether ``session`` missed the prompt cache before (remembers the last 10,000)."""
        with self._misses_lock:
            seen = session in self._misses
            self._misses[session] = None
            self._misses.move_to_end(session)
            while len(self._misses) > 10_000:
                self._misses.popitem(last=False)
            return seen

    def chat(self, body: dict[str, Any], headers: Any) -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("'messages' must be a non-empty list")
        meta, params = self._meta(body, headers), self._params(body, headers)
        tools = tools_mod.parse_tools(body.get("tools"))
        choice = tools_mod.parse_tool_choice(body.get("tool_choice"), tools)
        fmt = self.tool_format
        prepared = tools_mod.prepare_messages(messages, tools, fmt, self.raw_replies, template_tools=self.template_tools)
        native = tools if tools and self.template_tools else None
        session = (meta.execution_id, meta.agent_id)
        rendered = self.prompts.render_chat(session, prepared, tools=native)
        if rendered.reused_tokens == 0 and any(m.get("role") == "assistant" for m in messages):
            # once per session at info (a loop that rewrites its history, as smolagents does, misses every turn)
            (log.debug if self._missed(session) else log.info)(
                "chat prompt tokenized from scratch (no earlier turn matched)",
                execution_id=meta.execution_id, agent_id=meta.agent_id)
        # a forced call: its opening is context (appended to the prompt), the model writes the rest
        prefix = fmt.forced_prefix(choice) if tools else ""
        grammar = fmt.forced_grammar(choice, tools) if tools else None
        if grammar is not None:  # the rest of a forced call: arguments valid against the tool's schema
            params = dataclasses.replace(params, grammar=grammar)
        if prefix:
            rendered = Rendered(rendered.prompt_text + prefix,
                                np.concatenate([rendered.prompt_ids, self.prompts.encode(prefix)]).astype(np.int32),
                                rendered.reused_tokens)

        def remember(ids: np.ndarray, text: str, stop_text: str) -> None:
            self.prompts.remember_chat(session, prepared, rendered, ids, text, stop_text, reply_text=prefix + text,
                                       tools=native)

        calls = _ToolShape(fmt, prefix, self.raw_replies, self.new_call_id) if tools and choice.mode != "none" else None
        return self._run("chat.completion", body, meta, params, rendered, remember, calls=calls, prefix=prefix)

    def messages(self, body: dict[str, Any], headers: Any) -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        """Anthropic Messages (``/v1/messages``), served as the equivalent chat call."""
        result, stream = self.chat(anthropic.to_chat(body), headers)
        if stream is not None:
            return None, anthropic.stream_from_chat(stream, self.model_name)
        assert result is not None
        return anthropic.from_chat(result, self.model_name), None

    def responses(self, body: dict[str, Any], headers: Any) -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        """OpenAI Responses (``/v1/responses``), served as the equivalent chat call."""
        result, stream = self.chat(responses_api.to_chat(body), headers)
        if stream is not None:
            return None, responses_api.stream_from_chat(stream, body, self.model_name)
        assert result is not None
        return responses_api.from_chat(result, body, self.model_name), None

    def completion(self, body: dict[str, Any], headers: Any) -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        meta, params = self._meta(body, headers), self._params(body, headers)
        session = (meta.execution_id, meta.agent_id)
        if isinstance(prompt, str):
            rendered = self.prompts.render_text(session, prompt)

            def remember(ids: np.ndarray, text: str, stop_text: str) -> None:
                self.prompts.remember_text(session, rendered, ids, text, stop_text)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            rendered = Rendered("", np.asarray(prompt, dtype=np.int64).astype(np.int32), 0)
            if np.any(np.asarray(prompt) > np.iinfo(np.int32).max):
                raise InvalidArgument("prompt token ids must fit in int32")

            def remember(ids: np.ndarray, text: str, stop_text: str) -> None:
                pass
        else:
            raise InvalidArgument("'prompt' must be a string or a non-empty list of token ids")
        return self._run("text_completion", body, meta, params, rendered, remember)

    def _run(self, kind: str, body: dict[str, Any], meta: CallMeta, params: SamplingParams,
             rendered: Rendered, remember: Any, *, calls: _ToolShape | None = None,
             prefix: str = "") -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise InvalidArgument(f"n must be an integer from 1 to {MAX_N}")
        if n > 1:
            return self._run_many(n, kind, body, meta, params, rendered, remember, calls=calls, prefix=prefix)
        return self._run_one(kind, body, meta, params, rendered, remember, calls=calls, prefix=prefix)

    def _run_many(self, n: int, kind: str, body: dict[str, Any], meta: CallMeta, params: SamplingParams,
                  rendered: Rendered, remember: Any, *, calls: _ToolShape | None,
                  prefix: str) -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        """``n`` samples of one prompt: ``n`` gateway calls (own call ids and seeds) whose records
        are sibling branches of the execution's tree; choices in index order."""
        one = {**body, "n": 1}
        subs = [(dataclasses.replace(meta, call_id=meta.call_id if i == 0 else f"{meta.call_id}.{i}"),
                 params if params.seed is None else dataclasses.replace(params, seed=params.seed + i))
                for i in range(n)]

        def run(sub: tuple[CallMeta, SamplingParams]) -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
            return self._run_one(kind, one, sub[0], sub[1], rendered, remember, calls=calls, prefix=prefix)

        if body.get("stream"):
            return None, _merge_streams([run(sub)[1] for sub in subs])  # type: ignore[misc]
        with ThreadPoolExecutor(n, thread_name_prefix="openai-n") as pool:
            results = [r for r, _ in pool.map(run, subs)]
        merged: dict[str, Any] = dict(results[0])  # type: ignore[arg-type]
        merged["choices"] = []
        for i, r in enumerate(results):
            assert r is not None
            merged["choices"].append({**r["choices"][0], "index": i, "gyre": r["gyre"]})
        done = sum(int(r["usage"]["completion_tokens"]) for r in results if r)
        prompt = int(merged["usage"]["prompt_tokens"])
        merged["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                           "prompt_tokens_details": merged["usage"].get("prompt_tokens_details")}
        return merged, None

    def _run_one(self, kind: str, body: dict[str, Any], meta: CallMeta, params: SamplingParams,
                 rendered: Rendered, remember: Any, *, calls: _ToolShape | None = None,
                 prefix: str = "") -> tuple[dict[str, Any] | None, Iterator[bytes] | None]:
        call = self.gateway.new_call(meta, params, prompt_ids=rendered.prompt_ids)
        text_stops = self._stops(body)[1]
        engine_pieces = self.gateway.run(call)
        pieces = self._watch_stops(call, engine_pieces, text_stops) if text_stops else engine_pieces
        created = int(time.time())
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + call.request_id
        want_ids = bool(body.get("return_token_ids"))
        want_lp = bool(body.get("logprobs"))

        def finish() -> tuple[str, dict[str, Any], str]:
            ids, lps = call.output()
            text, stop_text = self._decode(ids, params)
            remember(ids, text, stop_text)
            gyre: dict[str, Any] = {"execution_id": meta.execution_id, "call_id": meta.call_id,
                                    "weight_version": call.result().weight_version,
                                    "reused_prompt_tokens": rendered.reused_tokens,
                                    "temperature": params.temperature}
            if want_ids:
                gyre["prompt_ids"] = call.prompt_ids.tolist()
                gyre["output_ids"] = ids.tolist()
                constrained = call.constrained_output()
                if constrained is not None:  # the grammar's forced tokens: context, never trained
                    gyre["output_forced"] = constrained[0].tolist()
            if want_lp:
                gyre["output_logprobs"] = lps.tolist()
            return text, gyre, _finish_reason(call.finish_reason)

        usage = lambda: {"prompt_tokens": len(call.prompt_ids), "completion_tokens": call.generated,  # noqa: E731
                         "total_tokens": len(call.prompt_ids) + call.generated,
                         "prompt_tokens_details": {"cached_tokens": call.cached_tokens}}
        if not body.get("stream"):
            for _ in pieces:
                pass
            text, gyre, reason = finish()
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": prefix + text}
                if calls is not None:
                    content, found = calls.shape(text)
                    if found:
                        choice["message"] = {"role": "assistant", "content": content, "tool_calls": found}
                        choice["finish_reason"] = _calls_finish(reason, found)
            else:
                choice["text"] = text
            if want_lp:
                choice["logprobs"] = _logprobs(self.tokenizer, call.output(), kind, call.top_output())
            return {"id": rid, "object": kind, "created": created, "model": self.model_name,
                    "choices": [choice], "usage": usage(), "gyre": gyre}, None
        # Start the call now, so routing/validation errors still get a proper HTTP status.
        first = next(pieces, None)
        head = [first] if first is not None else []
        opts = body.get("stream_options") or {}
        return None, self._sse(kind, rid, created, call, itertools.chain(head, pieces), engine_pieces, finish, usage,
                               calls=calls, prefix=prefix, text_stops=text_stops,
                               include_usage=isinstance(opts, dict) and bool(opts.get("include_usage")))

    def _sse(self, kind: str, rid: str, created: int, call: Any, pieces: Iterator[Piece], gen: Any,
             finish: Any, usage: Any, *, calls: _ToolShape | None = None, prefix: str = "",
             text_stops: Sequence[str] = (), include_usage: bool = False) -> Iterator[bytes]:
        obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"

        def event(delta_text: str | None, reason: str | None, extra: dict[str, Any] | None = None,
                  first: bool = False, tool_calls: list[dict[str, Any]] | None = None) -> bytes:
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if kind == "chat.completion":
                choice["delta"] = {} if delta_text is None else {"content": delta_text}
                if tool_calls:
                    choice["delta"] = {"tool_calls": tool_calls}
                if first:
                    choice["delta"]["role"] = "assistant"
            else:
                choice["text"] = delta_text or ""
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            payload.update(extra or {})
            return f"data: {json.dumps(payload)}\n\n".encode()

        sent = ""
        try:
            yield event("", None, first=True)
            for _ in pieces:
                ids, _lps = call.output()
                text, _stop = self._decode(ids, call.params)
                if text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                text = prefix + text
                if calls is not None:  # never stream what may become a tool call
                    text = text[:calls.fmt.holdback(text)]
                if text_stops:  # nor what may be the start of a stop string
                    text = text[:_stop_holdback(text, text_stops)]
                if len(text) > len(sent) and text.startswith(sent):
                    yield event(text[len(sent):], None)
                    sent = text
            text, gyre, reason = finish()
            found: list[dict[str, Any]] = []
            full = prefix + text
            if calls is not None:
                content, found = calls.shape(text)
                if found:
                    full, reason = content or "", _calls_finish(reason, found)
            tail = full[len(sent):] if full.startswith(sent) else ""
            if found:
                if tail:
                    yield event(tail, None)
                yield event(None, None, tool_calls=[{"index": k, **c} for k, c in enumerate(found)])
            yield event(None if found else tail, reason, {"usage": usage(), "gyre": gyre})
            if include_usage:  # stream_options.include_usage: a last chunk with no choices and the usage
                payload = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                           "usage": usage()}
                yield f"data: {json.dumps(payload)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            gen.close()  # a client that left cancels the engine-side request

    def _decode(self, ids: np.ndarray, params: SamplingParams) -> tuple[str, str]:
        """Output text without a trailing stop id, and the text of that stop id ("" if none)."""
        stop_text = ""
        if len(ids) and int(ids[-1]) in params.stop_token_ids:
            stop_text = self.tokenizer.decode([int(ids[-1])], skip_special_tokens=False)
            ids = ids[:-1]
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False), stop_text


MAX_N = 16  # samples per request


def _merge_streams(streams: list[Iterator[bytes]]) -> Iterator[bytes]:
    """One SSE stream of several one-choice streams: each event's choice gets its stream's index;
    usage-only events are summed into one; a single [DONE] at the end."""
    out: queue.Queue[tuple[int, bytes | None]] = queue.Queue()
    stop = threading.Event()

    def pump(i: int, s: Iterator[bytes]) -> None:
        try:
            for chunk in s:
                if stop.is_set():
                    break
                out.put((i, chunk))
        except Exception as exc:  # deliberate: reported in-band like a single stream's failure
            err = {"error": {"message": str(exc), "type": type(exc).__name__, "param": None, "code": "server_error"}}
            out.put((i, f"data: {json.dumps(err)}\n\n".encode()))
        finally:
            close = getattr(s, "close", None)
            if close is not None:
                close()
            out.put((i, None))

    for i, s in enumerate(streams):
        threading.Thread(target=pump, args=(i, s), name=f"openai-n-{i}", daemon=True).start()
    live = len(streams)
    usage: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    try:
        while live:
            i, chunk = out.get()
            if chunk is None:
                live -= 1
                continue
            data = chunk.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if event.get("choices") == [] and "usage" in event:  # include_usage: merged below
                u = event["usage"]
                usage = u if usage is None else {**usage, "completion_tokens": usage["completion_tokens"] +
                                                 u["completion_tokens"],
                                                 "total_tokens": usage["total_tokens"] + u["completion_tokens"]}
                last = event
                continue
            for c in event.get("choices", []):
                c["index"] = i
            yield f"data: {json.dumps(event)}\n\n".encode()
        if last is not None:
            yield f"data: {json.dumps({**last, 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        stop.set()


def _stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Where streamed text must pause: at a stop string, or a suffix that may begin one."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
            continue
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-k:]):
                cut = min(cut, len(text) - k)
                break
    return cut


class _ToolShape:
    """Turns a chat reply's text into (content, tool_calls) in the response's shape."""

    def __init__(self, fmt: Any, prefix: str, raw: tools_mod.RawReplies,
                 new_call_id: Callable[[], str] = tools_mod.new_call_id) -> None:
        self.fmt, self.prefix, self.raw, self.new_call_id = fmt, prefix, raw, new_call_id

    def shape(self, output_text: str) -> tuple[str | None, list[dict[str, Any]]]:
        full = self.prefix + output_text
        content, found = self.fmt.parse(full)
        if not found:
            return full, []
        ids = [self.new_call_id() for _ in found]
        self.raw.put(ids, full)  # the next turn's assistant message renders back to exactly this text
        return content, [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                         for i, c in zip(ids, found)]


def _calls_finish(reason: str, found: list[dict[str, Any]]) -> str:
    """finish_reason of a reply with tool calls: "tool_calls", or "length" when max_tokens cut a
    call's arguments short (an unfinished object, which a harness must not run; as OpenAI's API)."""
    if reason == "length":
        for c in found:
            try:
                json.loads(c["function"]["arguments"])
            except (ValueError, KeyError, TypeError):
                return "length"
    return "tool_calls"


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop" if reason == "" else reason


def _top_n(body: dict[str, Any]) -> int:
    """How many alternatives per position: chat ``top_logprobs`` (with ``logprobs: true``),
    completions ``logprobs: N``."""
    n = body.get("top_logprobs") if "messages" in body else body.get("logprobs")
    if n is None or n is False or n is True:
        return 0
    if not isinstance(n, int) or not 0 <= n <= 20:
        raise InvalidArgument(f"top_logprobs must be an integer from 0 to 20, got {n!r}")
    return n


def response_grammar(fmt: Any) -> GrammarSpec | None:
    """The grammar of ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
    or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidArgument("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise InvalidArgument(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _logprobs(tokenizer: Any, output: tuple[np.ndarray, np.ndarray], kind: str,
              tops: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    ids, lps = output
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    alt: list[list[tuple[str, float]]] = [[] for _ in tokens]
    if tops is not None:
        names = tokenizer.convert_ids_to_tokens(tops[0].reshape(-1).tolist())
        k = tops[0].shape[1]
        alt = [list(zip(names[i * k:(i + 1) * k], tops[1][i].tolist())) for i in range(len(tokens))]
    if kind == "chat.completion":
        return {"content": [{"token": t, "logprob": float(lp), "bytes": None,
                             "top_logprobs": [{"token": a, "logprob": float(v), "bytes": None} for a, v in top]}
                            for t, lp, top in zip(tokens, lps.tolist(), alt)]}
    return {"tokens": tokens, "token_logprobs": lps.tolist(),
            "top_logprobs": [dict(top) for top in alt] if tops is not None else None, "text_offset": None}


SESSION_TEMPERATURE = "x-gyre-session-temperature"
"""The header ``session_headers`` sets (never a client's: a plain route's headers do not reach
``_params`` under this name unless the client sent it, which only sets its own default)."""


class SessionEnded(Exception):
    """A session URL whose execution ended or was leased again (HTTP 410)."""
