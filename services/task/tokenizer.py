"""The built-in task's word-level tokenizer, built with `tokenizers` (no download).

Vocabulary: the special role tokens, the words the harness prompts use, GyreStack operators,
module names m1..m64 and the ten digits. Numbers are split into single digits (``-16`` is
``- 1 6``), so any test value is representable with a ~100-word vocabulary. Saved as an HF
tokenizer directory with a chat template, so ``AutoTokenizer.from_pretrained(dir)`` works and
``apply_chat_template`` produces exactly the ids the built-in harness builds by hand.

`Codec` is the harness's light-weight view (only the `tokenizers` package, no transformers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from services.task import prompts
from services.task.dsl import BINARY_OPS, STACK_OPS, UNARY_OPS

__all__ = ["build_tokenizer", "save_hf_tokenizer", "TokenCodec", "Codec", "CHAT_TEMPLATE"]

# Renders [{"role", "content"}] the way the harness concatenates segments; assistant turns end in <eos>.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|{{ m['role'] }}|> {{ m['content'] }} "
    "{%- if m['role'] == 'assistant' %} <eos>{% endif %} "
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)


def vocabulary() -> list[str]:
    """The full vocabulary in id order (deterministic)."""
    words: list[str] = list(prompts.SPECIAL_TOKENS)
    rest = list(prompts.WORDS) + sorted(BINARY_OPS) + sorted(UNARY_OPS) + sorted(STACK_OPS)
    rest += list(prompts.ERROR_REASONS) + [str(d) for d in range(10)]
    rest += [f"m{i}" for i in range(1, prompts.MAX_MODULES + 1)]
    for w in rest:
        if w not in words:
            words.append(w)
    return words


def build_tokenizer() -> Tokenizer:
    """A fresh `tokenizers.Tokenizer` for the built-in task (same ids every time)."""
    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Whitespace first, then split each word into module names, single digits, letter runs and
    # punctuation runs: "m12" stays one token, "-16" becomes "-", "1", "6", "->" stays "->".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(r"m[0-9]+|[0-9]|[a-z_]+|[^a-z_0-9]+"), behavior="isolated"),
        ]
    )
    tok.add_special_tokens(list(prompts.SPECIAL_TOKENS))
    return tok


def save_hf_tokenizer(out_dir: Path, *, model_max_length: int) -> None:
    """Write an HF tokenizer directory (tokenizer.json + config with chat template)."""
    from transformers import PreTrainedTokenizerFast  # heavy import, only when saving

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token="<bos>",
        eos_token=prompts.EOS,
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


class TokenCodec:
    """Text <-> int32 id arrays over a `tokenizers.Tokenizer` (only that package, no transformers);
    outputs are never re-tokenized. Segments repeat a lot, so encodings are cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self._cache: dict[str, np.ndarray] = {}

    def _id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer has no {token!r} token")
        return int(i)

    def encode(self, text: str) -> np.ndarray:
        """Ids of `text` (special tokens included)."""
        hit = self._cache.get(text)
        if hit is None:
            hit = np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
            hit.setflags(write=False)
            if len(self._cache) < 65536:
                self._cache[text] = hit
        return hit

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of generated ids without special tokens."""
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=True))


class Codec(TokenCodec):
    """The built-in word-level tokenizer's view for the harness (decoded words joined by single spaces)."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(tokenizer if tokenizer is not None else build_tokenizer())
        self.eos_id = self._id(prompts.EOS)
        self.pad_id = self._id("<pad>")
        self.unk_id = self._id("<unk>")
        self.bos_id = self._id("<bos>")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Codec:
        return cls(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))
