"""The tool-calling built-in model's tokenizer: a byte-level BPE the project trains, ChatML turns.

`train_tokenizer(texts)` trains a byte-level BPE (HF ``tokenizers``, deterministic for a given
corpus) with digits split one per token (constants copy digit by digit) and no other pre-split:
merges may cross spaces and punctuation, so the corpus's frequent phrases become single tokens
(a call's JSON boilerplate ``",Ġ"code":Ġ"``, a result's ``ĠstepĠsubĠ``). That keeps what a call
copies a few tokens from where it is written, which a 2-layer model learns quickly; with
word-level pre-splitting the constant sat ~30 tokens back and the warm start never learned the
copy. Any text is representable (byte level), so a third-party harness's prompts tokenize too. Turns are ChatML,
with role tags as special tokens so a conversation tokenizes segment by segment to the same ids as
a whole:

    <|im_start|>system\\n{instructions}\\n\\n{tools block}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{reply}<|im_end|>\\n        (a call: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>)
    <|im_start|>tool\\n{result}<|im_end|>\\n

`CHAT_TEMPLATE` renders exactly that (tools passed as ``apply_chat_template(tools=...)``), so the
gateway's OpenAI / Anthropic / Responses endpoints and the built-in tool agent build the same ids.
``<tool_call>`` and ``</tool_call>`` are added (not special) tokens: one id each, kept in decoded
text so the gateway's Hermes parser finds them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from services.task.tokenizer import TokenCodec

__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "IM_START", "IM_END", "PAD", "train_tokenizer", "save_hf_tokenizer",
           "hf_tokenizer",
           "ToolCodec", "render_system", "render_turn", "tools_block"]

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
ADDED_TOKENS = ("<tool_call>", "</tool_call>")
TOOLS_HEAD = "You can call functions. Their signatures, one JSON object per line:\n<tools>\n"
TOOLS_TAIL = ('</tools>\nTo call one, reply with a JSON object of its name and arguments between tags:\n'
              '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')

# Prefix-stable: adding a message only appends text. No whitespace control: every newline is
# literal. Assistant content is rendered as is (the gateway passes a tool-call reply's raw
# generated text), tool results as role "tool".
CHAT_TEMPLATE = (
    "{% set ns = namespace(system='', rest=messages) %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.system = messages[0]['content'] %}{% set ns.rest = messages[1:] %}"
    "{% endif %}"
    "{% if tools %}"
    "<|im_start|>system\n{% if ns.system %}{{ ns.system }}\n\n{% endif %}" + TOOLS_HEAD
    + "{% for t in tools %}{{ t | tojson }}\n{% endfor %}" + TOOLS_TAIL + "<|im_end|>\n"
    "{% elif ns.system %}<|im_start|>system\n{{ ns.system }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in ns.rest %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tools_block(tools: Sequence[dict[str, Any]]) -> str:
    """The tool list as the template renders it (``tools``: OpenAI function specs, unwrapped)."""
    lines = "".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) + "\n" for t in tools)
    return TOOLS_HEAD + lines + TOOLS_TAIL


def render_system(instructions: str, tools: Sequence[dict[str, Any]]) -> str:
    """The system turn with its tools, as `CHAT_TEMPLATE` renders it."""
    head = f"{instructions}\n\n" if instructions else ""
    return f"{IM_START}system\n{head}{tools_block(tools)}{IM_END}\n"


def render_turn(role: str, content: str, *, generation_prompt: bool = False) -> str:
    """One turn (``role`` user, tool or assistant), optionally followed by the assistant's opening."""
    return f"{IM_START}{role}\n{content}{IM_END}\n" + (f"{IM_START}assistant\n" if generation_prompt else "")


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 2048) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` (same corpus, same tokenizer)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def hf_tokenizer(tok: Tokenizer, *, model_max_length: int) -> Any:
    """The HF tokenizer the model directory holds (what the gateway loads): ``tok`` with the chat template."""
    from transformers import PreTrainedTokenizerFast  # heavy import, only when needed

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=PAD, eos_token=IM_END, pad_token=PAD,
                                   additional_special_tokens=[IM_START], model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, *, model_max_length: int) -> None:
    """Write an HF tokenizer directory (tokenizer.json + config with the chat template)."""
    hf_tokenizer(tok, model_max_length=model_max_length).save_pretrained(str(out_dir))


class ToolCodec(TokenCodec):
    """The tool model's tokenizer for the tool agent (decoded text keeps the tool-call tags and
    drops the role tags)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.eos_id = self._id(IM_END)
        self.pad_id = self._id(PAD)
        self.bos_id = self.pad_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ToolCodec:
        path = Path(model_dir) / "tokenizer.json"
        tok = Tokenizer.from_file(str(path))
        if tok.token_to_id("<tool_call>") is None or tok.token_to_id(IM_END) is None:
            raise ValueError(f"{model_dir} is not a tool-calling model's tokenizer (no <tool_call> / {IM_END} "
                             "token); xlong-tools-v1 needs one, e.g. the model 'builtin-tools'")
        return cls(tok)
