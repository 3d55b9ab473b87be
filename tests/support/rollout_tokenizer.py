"""A ChatML byte-level BPE tokenizer with a chat template, trained locally (no download)."""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "What is the capital of France? The capital of France is Paris.",
    "Please list three prime numbers: two, three and five are prime numbers.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "def add(a, b): return a + b  # numbers, strings and lists",
] * 20


def make_chatml_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE with ChatML specials and chat template (ids < ``vocab_size`` <= model vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(path))
    return path
