"""A harness-side conversation rendered through a real tokenizer's chat template, without drift.

Harnesses for real instruct models (a BPE tokenizer, a Jinja chat template) must never
re-tokenize what the model generated: ``encode(decode(ids))`` need not give ``ids`` back, and
a re-tokenized turn would make the trajectory tree branch where the conversation did not. So the
context is one growing token array:

    ask(user text):   render the template over all messages (+ generation prompt); the new text
                      after what the ids already stand for is tokenized and appended
    answer(out ids):  the model's ids are appended verbatim; its reply text (stop id stripped)
                      becomes the assistant message that later renders are checked against

If the model ended its turn with a stop id, the template's rendering of that end-of-turn marker
is not tokenized again. This is the same splice the gateway's OpenAI endpoint does
(services.rollout.chat), so a harness that builds ids here and one that sends text through the
OpenAI endpoint produce the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ChatContext"]


class ChatContext:
    """One conversation's token ids. Lifecycle: ChatContext(tokenizer, system) -> (ask -> answer)*."""

    def __init__(self, tokenizer: Any, messages: Sequence[dict[str, str]] = ()) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; use a tokenizer directory with one")
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos token id to end a turn with")
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = [dict(m) for m in messages]
        self.stop_ids: tuple[int, ...] = (int(eos),)
        self.ids = np.zeros(0, dtype=np.int32)
        self._text = ""  # the rendered text that self.ids stand for, up to the last generation prompt
        self._reply = ""  # the last reply's text (stop id stripped)
        self._stop_text = ""  # text of the stop id the last reply ended with ("" if cut off)

    def ask(self, content: str) -> np.ndarray:
        """Append a user turn and the generation prompt; returns the whole prompt's ids."""
        self.messages.append({"role": "user", "content": content})
        text = self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str)
        if not text.startswith(self._text):
            raise ValueError("the chat template rendered earlier turns differently once a turn was added; "
                             "this harness needs a prefix-stable template")
        rest = text[len(self._text):]
        if self._text:
            rest = self._after_reply(rest)
        self.ids = np.concatenate([self.ids, self._encode(rest)])
        self._text = text
        return self.ids

    def answer(self, output_ids: np.ndarray) -> str:
        """Append the model's output ids verbatim; returns the reply text (stop id stripped)."""
        out = np.asarray(output_ids, dtype=np.int32)
        body, self._stop_text = out, ""
        if len(out) and int(out[-1]) in self.stop_ids:
            body = out[:-1]
            self._stop_text = self.tokenizer.decode([int(out[-1])], skip_special_tokens=False)
        self._reply = self.tokenizer.decode(body.tolist(), skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": self._reply})
        self.ids = np.concatenate([self.ids, out])
        return self._reply

    def _after_reply(self, rest: str) -> str:
        """The part of ``rest`` (text after the last generation prompt) that follows the reply."""
        reply = self._reply
        if rest.startswith(reply):
            rest = rest[len(reply):]
        elif rest.lstrip().startswith(reply.strip()):  # templates may trim whitespace around content
            rest = rest.lstrip()[len(reply.strip()):]
        else:
            raise ValueError("the chat template rewrote an assistant reply; its ids cannot be kept verbatim")
        if self._stop_text and rest.lstrip().startswith(self._stop_text):
            rest = rest.lstrip()[len(self._stop_text):]  # the model already emitted this end-of-turn id
        return rest

    def _encode(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros(0, dtype=np.int32)
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
