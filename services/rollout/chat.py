"""Chat/completion prompts -> token ids that keep the exact ids of earlier turns (no drift).

OpenAI-speaking harnesses send the whole conversation as text every turn. Re-rendering and
re-tokenizing it can give different ids for the earlier turns than the model saw or generated
(BPE merges across turn boundaries, decode/encode round trips), which would make the trajectory
tree branch where the conversation did not. So after each call we remember the conversation
state, keyed by a digest of (execution, agent, messages up to and including the assistant reply
we returned):

    turn k:   messages M_k --render(add_generation_prompt)--> text T_k --tokenize--> P_k
              model output ids O_k, returned as text C_k (stop id stripped)
    turn k+1: messages M_k + [assistant C_k] + new  --render--> T_{k+1}
              if T_{k+1} starts with T_k, then C_k (up to template whitespace between them):
                  P_{k+1} = P_k + O_k + tokenize(rest)
              (the end-of-turn text of a stop id the model emitted is not tokenized again)
              else: tokenize T_{k+1} from scratch (a new branch, logged by the caller)

The chat template is rendered once per call; only the appended tail is tokenized. States are
kept in an LRU bounded by total tokens. Completions (``/v1/completions`` with a text prompt) reuse
a state when the new prompt text starts with an earlier prompt + its output text.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument

Message = dict[str, Any]


@dataclass(frozen=True)
class ConversationState:
    """One finished call: what it was prompted with and what it generated."""

    prompt_text: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    output_text: str
    # Text the last output id renders to when it is a stop/eos id (stripped from output_text).
    stop_text: str

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class Rendered:
    prompt_text: str
    prompt_ids: np.ndarray
    # Leading ids taken verbatim from an earlier call (0 = tokenized from scratch).
    reused_tokens: int


def canonical(message: Message) -> str:
    """Stable text of the parts of a message that shape the prompt."""
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidArgument("each message must be an object with a 'role'")
    keep = {k: message[k] for k in ("role", "content", "name", "tool_calls", "tool_call_id")
            if message.get(k) is not None}
    if isinstance(keep.get("content"), list):  # text parts and the same text as a string are one prompt
        keep["content"] = content_text(message)
    return json.dumps(keep, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def as_text_content(messages: Sequence[Message]) -> list[Message]:
    """Messages whose content is a list of text parts, with that content as one string (chat
    templates concatenate content as a string; clients such as smolagents send parts)."""
    return [{**m, "content": content_text(m)} if isinstance(m.get("content"), list) else m for m in messages]


def content_text(message: Message) -> str:
    """A message's content as one string (OpenAI allows a list of text parts)."""
    content = message.get("content")
    return "" if content is None else text_parts(content, "message content")


def text_parts(content: Any, where: str) -> str:
    """A string, or a list of ``{"type": "text", "text": ...}`` parts, as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(f"{where}: only text parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidArgument(f"{where} must be a string or a list of text parts")


class PromptCache:
    """Renders prompts with exact-id reuse (see module docstring). Thread-safe."""

    def __init__(self, tokenizer: Any, *, max_tokens: int = 8_000_000) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; use a tokenizer directory with one")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._states: OrderedDict[str, ConversationState] = OrderedDict()
        self._texts: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    # -- chat ----------------------------------------------------------------------------------
    def render_chat(self, session: tuple[str, str], messages: Sequence[Message],
                    tools: Sequence[dict[str, Any]] | None = None) -> Rendered:
        """``tools``: function specs the template renders itself (``apply_chat_template(tools=)``)."""
        if not messages:
            raise InvalidArgument("messages must be a non-empty list")
        for m in messages:
            content_text(m)  # validates
        text = self._apply_template(messages, tools)
        if tools:
            session = (session[0], session[1] + "\0tools:" + json.dumps(list(tools), sort_keys=True))
        digests = self._prefix_digests(session, messages)
        # Longest earlier conversation that this one extends (its last message is our reply).
        for i in range(len(messages) - 1, -1, -1):
            if messages[i].get("role") != "assistant":
                continue
            state = self._get(digests[i])
            if state is None:
                continue
            ids = self._splice(state, text)
            if ids is not None:
                return Rendered(text, ids, state.tokens)
        return Rendered(text, self._encode(text), 0)

    def remember_chat(self, session: tuple[str, str], messages: Sequence[Message], rendered: Rendered,
                      output_ids: np.ndarray, output_text: str, stop_text: str, *, reply_text: str | None = None,
                      tools: Sequence[dict[str, Any]] | None = None) -> None:
        """Record a finished chat call under the digest of messages + [its assistant reply]
        (``reply_text``: the reply as the next request's messages carry it, when it is more than
        the output, e.g. a forced tool-call opening + the output)."""
        if tools:
            session = (session[0], session[1] + "\0tools:" + json.dumps(list(tools), sort_keys=True))
        reply = {"role": "assistant", "content": output_text if reply_text is None else reply_text}
        key = self._prefix_digests(session, [*messages, reply])[-1]
        self._put(key, ConversationState(rendered.prompt_text, rendered.prompt_ids,
                                         np.asarray(output_ids, dtype=np.int32), output_text, stop_text))

    # -- completions ---------------------------------------------------------------------------
    def render_text(self, session: tuple[str, str], prompt: str) -> Rendered:
        with self._lock:
            keys = list(self._texts.get(session, ()))
        for key in reversed(keys):
            state = self._get(key)
            if state is None:
                continue
            ids = self._splice(state, prompt)
            if ids is not None:
                return Rendered(prompt, ids, state.tokens)
        return Rendered(prompt, self._encode(prompt, special=True), 0)

    def remember_text(self, session: tuple[str, str], rendered: Rendered, output_ids: np.ndarray,
                      output_text: str, stop_text: str) -> None:
        key = "text:" + hashlib.sha256(
            f"{session!r}\0{rendered.prompt_text}\0{output_text}".encode()).hexdigest()
        self._put(key, ConversationState(rendered.prompt_text, rendered.prompt_ids,
                                         np.asarray(output_ids, dtype=np.int32), output_text, stop_text))
        with self._lock:
            keys = self._texts.setdefault(session, [])
            keys.append(key)
            del keys[:-4]  # the few most recent prompts of a session are enough to extend
            self._texts.move_to_end(session)
            while len(self._texts) > 100_000:
                self._texts.popitem(last=False)

    # -- internals -----------------------------------------------------------------------------
    def _splice(self, state: ConversationState, text: str) -> np.ndarray | None:
        if not text.startswith(state.prompt_text):
            return None
        rest = text[len(state.prompt_text):]
        content = state.output_text
        if not rest.startswith(content):
            # Templates may put whitespace between the generation prompt and the content (which the
            # model never saw): skip it, the model's own ids follow the prompt directly.
            rest, content = rest.lstrip(), content.lstrip()
            if not rest.startswith(content):
                return None
        rest = rest[len(content):]
        if state.stop_text and rest.lstrip().startswith(state.stop_text):
            rest = rest.lstrip()[len(state.stop_text):]  # the model already emitted this end-of-turn id
        tail = self._encode(rest) if rest else np.zeros(0, dtype=np.int32)
        return np.concatenate([state.prompt_ids, state.output_ids, tail]).astype(np.int32)

    def encode(self, text: str) -> np.ndarray:
        """``text`` tokenized as a continuation (no special tokens added)."""
        return self._encode(text)

    def _apply_template(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None = None) -> str:
        extra = {"tools": [{"type": "function", "function": t} for t in tools]} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(as_text_content(messages), tokenize=False,
                                                      add_generation_prompt=True, **extra)
        except Exception as exc:  # template errors are the caller's malformed messages
            raise InvalidArgument(f"cannot render the chat template for these messages: {exc}") from exc
        assert isinstance(text, str)
        return text

    def _encode(self, text: str, *, special: bool = False) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    @staticmethod
    def _prefix_digests(session: tuple[str, str], messages: Sequence[Message]) -> list[str]:
        """Digest of (session, messages[:i+1]) for every i, in O(total message bytes)."""
        h = hashlib.sha256(f"{session[0]}\0{session[1]}".encode())
        out = []
        for m in messages:
            h.update(canonical(m).encode())
            h.update(b"\0")
            out.append(h.copy().hexdigest())
        return out

    def _get(self, key: str) -> ConversationState | None:
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
            return state

    def _put(self, key: str, state: ConversationState) -> None:
        with self._lock:
            old = self._states.pop(key, None)
            if old is not None:
                self._tokens -= old.tokens
            self._states[key] = state
            self._tokens += state.tokens
            while self._tokens > self.max_tokens and len(self._states) > 1:
                _, dropped = self._states.popitem(last=False)
                self._tokens -= dropped.tokens


def chat_events(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The events of a chat-completions SSE stream (``data: {...}`` chunks), ``[DONE]`` left out:
    what the Messages and Responses streams are translated from."""
    for raw in chunks:
        data = raw.decode().removeprefix("data: ").strip()
        if data != "[DONE]":
            yield json.loads(data)
