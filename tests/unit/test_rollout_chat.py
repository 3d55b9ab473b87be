"""PromptCache: later turns keep the exact ids the model saw and generated (no re-tokenization drift)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from services.rollout.chat import PromptCache
from tests.support.rollout_tokenizer import make_chatml_tokenizer

SESSION = ("ex-1", "main")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(str(make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))))


def char_ids(tok: Any, text: str) -> np.ndarray:
    """A valid but non-canonical tokenization (one id per character), as a model may generate it."""
    return np.concatenate([tok(c, add_special_tokens=False)["input_ids"] for c in text]).astype(np.int32)


def test_next_turn_reuses_generated_ids_that_re_tokenization_would_change(chatml: Any) -> None:
    cache = PromptCache(chatml)
    m1 = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"}]
    r1 = cache.render_chat(SESSION, m1)
    assert r1.reused_tokens == 0
    reply = "The capital of France is Paris."
    end = chatml.convert_tokens_to_ids("<|im_end|>")
    out = np.append(char_ids(chatml, reply), end).astype(np.int32)
    cache.remember_chat(SESSION, m1, r1, out, reply, "<|im_end|>")

    m2 = [*m1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And of Spain?"}]
    r2 = cache.render_chat(SESSION, m2)
    head = np.concatenate([r1.prompt_ids, out])
    np.testing.assert_array_equal(r2.prompt_ids[:len(head)], head)
    assert r2.reused_tokens == len(head)
    tail = chatml("\n<|im_start|>user\nAnd of Spain?<|im_end|>\n<|im_start|>assistant\n",
                  add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(r2.prompt_ids[len(head):], tail)
    naive = chatml(r2.prompt_text, add_special_tokens=False)["input_ids"]
    assert naive[:len(head)] != head.tolist(), "the test must exercise a tokenization that drifts"
    assert chatml.decode(r2.prompt_ids) == chatml.decode(naive)


def test_text_parts_render_and_reuse_like_strings(chatml: Any) -> None:
    """Clients that send content as a list of text parts (smolagents, the openai SDK's typed
    messages) get the prompt a string would, and the next turn reuses the recorded ids."""
    cache = PromptCache(chatml)
    parts = lambda text: [{"type": "text", "text": t} for t in (text[:5], text[5:])]  # noqa: E731
    m1 = [{"role": "system", "content": parts("You are terse.")}, {"role": "user", "content": parts("Hello there")}]
    r1 = cache.render_chat(SESSION, m1)
    plain = PromptCache(chatml).render_chat(SESSION, [{**m, "content": "".join(p["text"] for p in m["content"])}
                                                      for m in m1])
    assert r1.prompt_text == plain.prompt_text
    out = np.append(char_ids(chatml, "Hi."), chatml.convert_tokens_to_ids("<|im_end|>")).astype(np.int32)
    cache.remember_chat(SESSION, m1, r1, out, "Hi.", "<|im_end|>")
    r2 = cache.render_chat(SESSION, [*m1, {"role": "assistant", "content": parts("Hi.")},
                                     {"role": "user", "content": "Bye"}])
    assert r2.reused_tokens == len(r1.prompt_ids) + len(out)
    with pytest.raises(InvalidArgument, match="only text parts"):
        cache.render_chat(SESSION, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_other_sessions_and_edited_replies_do_not_reuse(chatml: Any) -> None:
    cache = PromptCache(chatml)
    m1 = [{"role": "user", "content": "hi"}]
    r1 = cache.render_chat(SESSION, m1)
    cache.remember_chat(SESSION, m1, r1, char_ids(chatml, "hello there"), "hello there", "")
    m2 = [*m1, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"}]
    assert cache.render_chat(("ex-2", "main"), m2).reused_tokens == 0
    edited = [*m1, {"role": "assistant", "content": "hello THERE"}, {"role": "user", "content": "bye"}]
    assert cache.render_chat(SESSION, edited).reused_tokens == 0
    assert cache.render_chat(SESSION, m2).reused_tokens == len(r1.prompt_ids) + len("hello there")


def test_template_whitespace_between_prompt_and_reply_is_skipped(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "hi", "there", "how", "are", "you", "fine"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<eos>", "<|user|>", "<|assistant|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{%- for m in messages -%}<|{{ m['role'] }}|> {{ m['content'] }} "
                         "{%- if m['role'] == 'assistant' %} <eos>{% endif %} {% endfor -%}"
                         "{%- if add_generation_prompt %}<|assistant|>{% endif -%}")
    cache = PromptCache(tok)
    m1 = [{"role": "user", "content": "hi"}]
    r1 = cache.render_chat(SESSION, m1)
    out = np.array([5, 1], np.int32)  # "there" <eos>
    cache.remember_chat(SESSION, m1, r1, out, "there", "<eos>")
    m2 = [*m1, {"role": "assistant", "content": "there"}, {"role": "user", "content": "how are you"}]
    r2 = cache.render_chat(SESSION, m2)
    assert r2.prompt_ids.tolist() == [*r1.prompt_ids.tolist(), 5, 1, 2, 6, 7, 8, 3]


def test_completion_prompts_extend_earlier_text(chatml: Any) -> None:
    cache = PromptCache(chatml)
    r1 = cache.render_text(SESSION, "The quick brown")
    out = char_ids(chatml, " fox")
    cache.remember_text(SESSION, r1, out, " fox", "")
    r2 = cache.render_text(SESSION, "The quick brown fox jumps")
    np.testing.assert_array_equal(r2.prompt_ids[:len(r1.prompt_ids) + len(out)], np.concatenate([r1.prompt_ids, out]))
    assert cache.render_text(SESSION, "A different text").reused_tokens == 0


def test_cache_is_bounded_in_tokens(chatml: Any) -> None:
    cache = PromptCache(chatml, max_tokens=60)
    for i in range(20):
        m = [{"role": "user", "content": f"question number {i}"}]
        r = cache.render_chat(SESSION, m)
        cache.remember_chat(SESSION, m, r, np.arange(5, dtype=np.int32), "abcde", "")
    assert cache._tokens <= 60 and len(cache._states) < 20
