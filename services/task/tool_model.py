"""The built-in tool-calling model: byte-level BPE, ChatML with tools, warm-started on tool calls.

`ensure_tool_model(cache_dir)` returns ``<cache_dir>/builtin-tools``, a local HF checkpoint (Qwen3
architecture, 64K positions, tokenizer with a chat template that renders tools) that every service
loads with ``from_pretrained`` (model name ``builtin-tools``). Built once, deterministically:

    1. a byte-level BPE trained on the text of tool-agent demonstrations (services.task.tool_demos,
       first run with a bytes-only tokenizer, so the corpus does not depend on the tokenizer);
    2. demonstrations again with that tokenizer: the tool agent (services.task.tool_agent) driven by
       the scripted demonstrator, its calls written as ``<tool_call>{"name": ..., "arguments": ...}``,
       and the shell dialect (``gyre-task`` commands in bash calls, mini-swe-agent's loop);
    3. the supervised pass of the word-level model (services.task.model.warm_start): last-turn
       snippets first, then whole contexts, loss on generated tokens only;
    4. save; the stamp records the spec's hash, so a changed spec rebuilds.

Run ``python -m services.task.tool_model [cache_dir]`` to build it and print its held-out pass rate.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from services.task.model import ModelSpecBase, build_facts, builtin_config, ensure_model_dir, torch_threads, warm_start
from services.task.tool_agent import ToolAgentConfig
from services.task.tool_env import INSTRUCTIONS, TOOLS
from services.task.claude_code_dialect import CLAUDE_CODE_BASH_TOOL, CLAUDE_CODE_IDENTITY, CLAUDE_CODE_VERSION
from services.task.tool_shell import BASH_TOOL, CLIENT, SHELL_INSTRUCTIONS

__all__ = ["ToolModelSpec", "ensure_tool_model", "MODEL_NAME", "TOOL_BUILD_VERSION"]

TOOL_BUILD_VERSION = "builtin-tools-v3"  # v2: smolagents contexts include the final_answer call; v3: Claude Code
MODEL_NAME = "builtin-tools"


@dataclass(frozen=True, kw_only=True)
class ToolModelSpec(ModelSpecBase):
    """Everything that determines the tool model's checkpoint (its hash names the build); the
    architecture and warm-start fields are `ModelSpecBase`'s."""

    demo_tasks: int = 300
    """Train tasks the demonstrator solves for the warm start."""
    snippet_steps: int = 300
    """Optimizer steps on last-turn snippets (twice the word-level model's: several dialects to learn)."""
    sft_steps: int = 600
    """Optimizer steps on whole contexts (three dialects: 450 left the shell dialect behind)."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    vocab_size: int = 2048
    """Upper bound on the BPE vocabulary (the corpus may support fewer merges)."""
    corpus_tasks: int = 100
    """Train tasks whose demonstrations are the tokenizer's corpus (as many again in the shell dialect)."""
    shell_demo_tasks: int = 250
    """Train tasks the demonstrator solves through ``gyre-task`` behind a bash tool, the way
    mini-swe-agent runs them (services.task.tool_shell); 0: the model knows only the functions."""
    smolagents_demo_tasks: int = 100
    """Train tasks the demonstrator solves through smolagents' own loop (its ToolCallingAgent, its
    requests through the gateway's endpoint code; services.task.tool_demos.run_smolagents_demo);
    0: the model has never seen that loop's conversation (bench/results/tool_model.md measures
    the mix of the three dialects)."""
    claude_code_demo_tasks: int = 60
    """Train tasks the demonstrator solves through Claude Code's conversation (its system, Bash
    tool and turns as the pinned CLI sends them in the claude-code loop; services.task.
    claude_code_dialect); 0: the model has never seen that CLI's requests."""
    agent: ToolAgentConfig = field(default_factory=ToolAgentConfig)
    """Tool-agent knobs of the demonstration runs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.corpus_tasks < 1 or self.shell_demo_tasks < 0 or self.smolagents_demo_tasks < 0
                or self.claude_code_demo_tasks < 0 or not 300 <= self.vocab_size <= 65_536):
            raise ValueError("corpus_tasks must be >= 1, shell_demo_tasks, smolagents_demo_tasks and "
                             "claude_code_demo_tasks >= 0 and vocab_size in [300, 65536].")

    def digest(self) -> str:
        # the tools and instructions are what the model is trained to see: a change to them rebuilds it
        # so is the loop whose conversation it learns (its prompts are its own: they come with its version)
        smolagents = version("smolagents") if self.smolagents_demo_tasks else ""
        blob = json.dumps({"version": TOOL_BUILD_VERSION, "tools": TOOLS, "instructions": INSTRUCTIONS,
                           "shell": [SHELL_INSTRUCTIONS, BASH_TOOL, CLIENT], "smolagents": smolagents,
                           "claude_code": [CLAUDE_CODE_VERSION, CLAUDE_CODE_IDENTITY, CLAUDE_CODE_BASH_TOOL],
                           **asdict(self)},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _build(out_dir: Path, spec: ToolModelSpec) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from services.task.tool_demos import collect_tool_demonstrations, demo_texts
    from services.task.tool_tokenizer import ToolCodec, save_hf_tokenizer, train_tokenizer

    with torch_threads(spec.threads):
        t0 = time.monotonic()
        # The corpus is rendered with a bytes-only tokenizer and no context limit: whole, uncut turns.
        boot = ToolCodec(train_tokenizer([], vocab_size=300))
        unbounded = replace(spec.agent, context_limit_tokens=1 << 30, max_new_tokens=1024, summary_max_new_tokens=1024)
        # smolagents' loop: a quarter as many tasks (its turns repeat the same framing)
        corpus = {"tools": spec.corpus_tasks, "shell": spec.corpus_tasks if spec.shell_demo_tasks else 0,
                  "smolagents": -(-spec.corpus_tasks // 4) if spec.smolagents_demo_tasks else 0,
                  "claude-code": -(-spec.corpus_tasks // 4) if spec.claude_code_demo_tasks else 0}
        texts = [text for dialect, n in corpus.items() if n
                 for text in demo_texts(boot, num_tasks=n, params=spec.task, agent=unbounded,
                                        noise=spec.noise, seed=spec.seed + 1, dialect=dialect)]
        tok = train_tokenizer(texts, vocab_size=spec.vocab_size)
        codec = ToolCodec(tok)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(builtin_config(spec, codec), attn_implementation="sdpa")
        demos = collect_tool_demonstrations(codec, num_tasks=spec.demo_tasks, params=spec.task, agent=spec.agent,
                                            noise=spec.noise, seed=spec.seed, shell_tasks=spec.shell_demo_tasks,
                                            smolagents_tasks=spec.smolagents_demo_tasks,
                                            claude_code_tasks=spec.claude_code_demo_tasks)
        losses = warm_start(model, demos, spec, pad_id=codec.pad_id)
        model.save_pretrained(str(out_dir), safe_serialization=True)
        save_hf_tokenizer(tok, out_dir, model_max_length=spec.max_positions)
        return {"vocab": codec.vocab_size, **build_facts(demos, losses, t0)}


def ensure_tool_model(cache_dir: str | Path = ".gyre/models", *, spec: ToolModelSpec | None = None) -> Path:
    """Path of the warm-started tool model, building it first if it is missing or stale."""
    spec = spec or ToolModelSpec()
    return ensure_model_dir(cache_dir, MODEL_NAME, spec.digest(), asdict(spec), lambda out: _build(out, spec))


if __name__ == "__main__":
    path = ensure_tool_model(sys.argv[1] if len(sys.argv) > 1 else ".gyre/models")
    print(path)
    print((path / "gyre_build.json").read_text())
