"""The built-in policy: a tiny Qwen3-architecture causal LM, warm-started on demonstrations.

`ensure_builtin_model(cache_dir)` returns ``<cache_dir>/builtin-tiny``, a local HF checkpoint
directory (config.json, model.safetensors, tokenizer with chat template) that every service loads
with ``from_pretrained``. It is built once, deterministically, and reused:

    1. tokenizer (services.task.tokenizer) and a Qwen3Config from `BuiltinModelSpec`, seeded init;
    2. demonstrations: the real agent loop driven by the sloppy demonstrator (services.task.demos);
    3. a short supervised pass (loss on generated tokens only): step snippets first, then whole
       contexts — one to two minutes on one CPU thread;
    4. save; a ``gyre_build.json`` stamp records the spec hash, so a changed spec rebuilds.

Concurrent callers (several services starting at once) serialize on a file lock; the directory
appears atomically (built in a temporary directory, then renamed).

Run ``python -m services.task.model [cache_dir]`` to build and print the held-out pass rates.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.task.agent import AgentConfig
from services.task.demos import DemoNoise, Demonstrations, collect_demonstrations
from services.task.spec import TaskParams
from services.task.tokenizer import Codec, save_hf_tokenizer

__all__ = ["ModelSpecBase", "BuiltinModelSpec", "ensure_builtin_model", "ensure_model_dir", "builtin_config", "warm_start",
           "BUILD_VERSION"]

BUILD_VERSION = "builtin-tiny-v2"
MODEL_DIR_NAME = "builtin-tiny"
_STAMP = "gyre_build.json"


@dataclass(frozen=True, kw_only=True)
class ModelSpecBase:
    """What every built-in model spec has: the architecture, the demonstrations and the warm start."""

    layers: int = 2
    """Transformer layers."""
    hidden: int = 128
    """Hidden size; head_dim = hidden / heads."""
    heads: int = 4
    """Attention heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate: int = 384
    """MLP width."""
    max_positions: int = 65_536
    """Longest context the model is configured for, in tokens (RoPE needs no table: it is free)."""
    rope_theta: float = 1_000_000.0
    """RoPE base: large enough that the slowest rotation (wavelength ~2.6M tokens at head_dim 32)
    never wraps within ``max_positions`` (at base 10,000 it wraps after ~35K tokens)."""
    demo_tasks: int = 600
    """Train tasks the demonstrator solves for the warm start."""
    snippet_steps: int = 150
    """First-phase optimizer steps on short snippets (a call's last request and its answer: the
    model learns to copy constants fast)."""
    sft_steps: int = 300
    """Second-phase optimizer steps on whole demonstrated contexts."""
    batch_size: int = 32
    """Sequences per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, linear warmup, cosine decay)."""
    seed: int = 0
    """Seeds the init, the demonstrations and the batch order."""
    threads: int = 1
    """torch threads during the build (fixed, so the build is reproducible)."""
    noise: DemoNoise = field(default_factory=DemoNoise)
    """How the demonstrator errs (sets the warm start's distance from the ceiling)."""
    task: TaskParams = field(default_factory=TaskParams)
    """Task knobs of the demonstration tasks."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0, got {self.hidden}/{self.heads}/{self.kv_heads}.")
        if min(self.layers, self.demo_tasks, self.batch_size, self.threads) < 1 or min(self.sft_steps,
                                                                                       self.snippet_steps) < 0:
            raise ValueError("layers, demo_tasks, batch_size and threads must be >= 1, sft/snippet steps >= 0.")
        if self.max_positions < 2 or self.rope_theta <= 1:
            raise ValueError(f"need max_positions >= 2 and rope_theta > 1, got {self.max_positions}/{self.rope_theta}.")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}.")


@dataclass(frozen=True, kw_only=True)
class BuiltinModelSpec(ModelSpecBase):
    """Everything that determines the built-in checkpoint (its hash names the build)."""

    snippet_steps: int = 300
    """First-phase optimizer steps on short snippets (twice the base's 150: copying a call's module
    name takes longer to learn than copying a constant)."""
    task: TaskParams = field(default_factory=lambda: TaskParams(call_pct=80))
    """Task knobs of the demonstration tasks: 4 modules, most of them calling an earlier one, so
    that the demonstrations hold many calls to copy."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Harness knobs of the demonstration runs (temperature > 0, so retries appear)."""
    relabel_pct: int = 50
    """Percent of demonstrations whose modules get other names (services.task.demos.relabel_modules),
    so that the warm start learns to copy a call step's module name rather than favour the few names
    its short demonstration tasks use. At 0 (and 150 snippet steps, calls in 30 % of modules) the
    warm start answered a call to ``m7`` with ``x m2`` and RL never got past 40 % of calls right
    (bench/results/heldout_kinds.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.relabel_pct <= 100:
            raise ValueError(f"relabel_pct must be a percentage, got {self.relabel_pct}.")

    def digest(self) -> str:
        blob = json.dumps({"version": BUILD_VERSION, **asdict(self)}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class CodecIds(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...


def builtin_config(spec: ModelSpecBase, codec: CodecIds) -> Any:
    """The Qwen3Config of a built-in model (vocab padded to a multiple of 8)."""
    from transformers import Qwen3Config

    vocab = int(math.ceil(codec.vocab_size / 8) * 8)
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id,
    )


def _batches(lengths: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Batches of similar length (little padding), in a random order each epoch."""
    by_len = np.argsort(lengths, kind="stable")
    chunks = [by_len[i : i + batch_size] for i in range(0, len(by_len), batch_size)]
    out: list[np.ndarray] = []
    while len(out) < steps:
        out.extend(chunks[j] for j in rng.permutation(len(chunks)))
    return out[:steps]


def warm_start(model: Any, demos: Demonstrations, spec: ModelSpecBase, *, pad_id: int) -> list[float]:
    """The supervised pass: next-token loss on generated positions only, first on step snippets
    (batches twice as large, they are short), then on whole contexts; returns the loss curve."""
    import torch

    rng = np.random.default_rng(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.98))
    total = spec.snippet_steps + spec.sft_steps
    warmup = max(1, total // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return spec.lr * 0.5 * (1 + math.cos(math.pi * frac))

    plan: list[tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]] = []
    for data, steps, size in ((demos.snippets, spec.snippet_steps, 2 * spec.batch_size),
                              (demos.sequences, spec.sft_steps, spec.batch_size)):
        if steps and data:
            plan += [(data, idx) for idx in _batches(np.asarray([len(s) for s, _ in data]), size, steps, rng)]
    losses: list[float] = []
    model.train()
    for step, (data, idx) in enumerate(plan):
        width = max(len(data[i][0]) for i in idx)
        ids = np.full((len(idx), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), width), dtype=bool)
        attn = np.zeros((len(idx), width), dtype=np.int64)
        for row, i in enumerate(idx):
            s, m = data[i]
            ids[row, : len(s)], mask[row, : len(s)], attn[row, : len(s)] = s, m, 1
        ids_t = torch.from_numpy(ids)
        logits = model(input_ids=ids_t, attention_mask=torch.from_numpy(attn)).logits
        target_mask = torch.from_numpy(mask[:, 1:])
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        nll = -logp.gather(-1, ids_t[:, 1:, None])[..., 0]
        loss = (nll * target_mask).sum() / target_mask.sum().clamp(min=1)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch uses ``n`` threads inside the block (a build is reproducible only at a fixed count)."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def build_facts(demos: Demonstrations, losses: list[float], t0: float) -> dict[str, Any]:
    """What a build's stamp records about its warm start."""
    return {
        "demo_sequences": len(demos.sequences),
        "demo_snippets": len(demos.snippets),
        "demo_tokens": int(sum(len(s) for s, _ in demos.sequences)),
        "sft_loss_first": losses[0] if losses else None,
        "sft_loss_last": losses[-1] if losses else None,
        "build_s": round(time.monotonic() - t0, 1),
    }


def _build(out_dir: Path, spec: BuiltinModelSpec) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch_threads(spec.threads):
        t0 = time.monotonic()
        codec = Codec()
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(builtin_config(spec, codec), attn_implementation="sdpa")
        demos = collect_demonstrations(
            num_tasks=spec.demo_tasks, params=spec.task, agent=spec.agent, noise=spec.noise, codec=codec, seed=spec.seed,
            relabel_pct=spec.relabel_pct,
        )
        losses = warm_start(model, demos, spec, pad_id=codec.pad_id)
        model.save_pretrained(str(out_dir), safe_serialization=True)
        save_hf_tokenizer(out_dir, model_max_length=spec.max_positions)
        return build_facts(demos, losses, t0)


def ensure_builtin_model(cache_dir: str | Path = ".gyre/models", *, spec: BuiltinModelSpec | None = None) -> Path:
    """Path of the warm-started built-in checkpoint, building it first if it is missing or stale."""
    spec = spec or BuiltinModelSpec()
    return ensure_model_dir(cache_dir, MODEL_DIR_NAME, spec.digest(), asdict(spec), lambda out: _build(out, spec))


def ensure_model_dir(cache_dir: str | Path, name: str, digest: str, spec: dict[str, Any],
                     build: Callable[[Path], dict[str, Any]]) -> Path:
    """``<cache_dir>/<name>``, built by ``build(tmp_dir)`` (which returns facts for the stamp) unless
    its stamp already carries ``digest``; one builder at a time, the directory appears atomically."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / name

    def fresh() -> bool:
        try:
            return bool(json.loads((out / _STAMP).read_text())["digest"] == digest)
        except (OSError, ValueError, KeyError):
            return False

    if fresh():
        return out
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if fresh():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
        try:
            info = build(tmp)
            (tmp / _STAMP).write_text(json.dumps({"digest": digest, "spec": spec, **info}, indent=1, default=str))
            if out.exists():
                stale = cache / f".{name}-stale-{os.getpid()}"
                os.replace(out, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    path = ensure_builtin_model(sys.argv[1] if len(sys.argv) > 1 else ".gyre/models")
    print(path)
    print((path / _STAMP).read_text())
