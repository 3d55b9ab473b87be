"""Atomic, exactly-resumable trainer checkpoints.

Layout under ``root``:

    step-000004/                 one complete checkpoint (after the update of step 3 -> version 4)
        model.safetensors        weights (safetensors)
        optimizer.safetensors    optimizer tensors, keyed "<param index>.<state key>"
        state.json               step, version, optimizer param_groups/scalars, python RNG, job info
        rng.safetensors          torch (+ CUDA) RNG states, numpy's as uint32 words
        COMPLETE                 written last, holds the sha256 of every other file
    LATEST                       name of the newest complete checkpoint (replaced atomically)

A save writes everything into ``.tmp-step-000004-<pid>/``, fsyncs each file, renames the
directory into place (atomic on POSIX) and then replaces LATEST via rename. A crash at any
point leaves either the previous checkpoint or the new one - never a torn one: ``load_latest``
only accepts a directory whose COMPLETE manifest matches its files, and falls back to the newest
older complete checkpoint when LATEST points at something missing or damaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from services.common.logging import get_logger

log = get_logger(__name__)

_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint (tensors on CPU)."""

    path: Path
    step: int            # the next step to train
    version: int         # weight version of ``model``
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extra: dict[str, Any]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _optimizer_to_flat(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (safetensors) and JSON-able scalars."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, pstate in state["state"].items():
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        idx, _, key = name.partition(".")
        state.setdefault(int(idx), {})[key] = t
    for idx, scalars in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(scalars)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All RNG states: tensors for safetensors, python's as JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    py = random.getstate()
    return tensors, {"numpy": [kind, int(pos), int(has_gauss), float(gauss)], "python": [py[0], list(py[1]), py[2]]}


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    v, state, g = meta["python"]
    random.setstate((v, tuple(state), g))


def save_checkpoint(root: str | os.PathLike[str], *, step: int, version: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None) -> Path:
    """Atomically write a checkpoint named after ``version``; returns its directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{version:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    final = root / name
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # safetensors refuses shared storage (tied embeddings): store each distinct tensor's bytes once.
    save_file(_untie(weights), str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_to_flat(optimizer.state_dict())
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    state = {"step": step, "version": version, "optimizer": opt_meta, "rng": rng_meta, "extra": extra or {}}
    (tmp / "state.json").write_text(json.dumps(state))
    for f in _FILES:
        _fsync_file(tmp / f)
    manifest = {f: _sha256(tmp / f) for f in _FILES}
    (tmp / "COMPLETE").write_text(json.dumps(manifest))
    _fsync_file(tmp / "COMPLETE")
    _fsync_dir(tmp)
    if final.exists() and is_complete(final):
        # The same version is already safely on disk (a step redone after a resume): keep it,
        # never delete a good checkpoint to replace it.
        shutil.rmtree(tmp)
    else:
        if final.exists():  # a damaged leftover of this version: move it out of the way first
            os.rename(final, root / f".tmp-damaged-{name}-{os.getpid()}")
        os.rename(tmp, final)
    _fsync_dir(root)
    latest_tmp = root / f".LATEST.{os.getpid()}"
    latest_tmp.write_text(name)
    _fsync_file(latest_tmp)
    os.replace(latest_tmp, root / "LATEST")
    _fsync_dir(root)
    log.info("checkpoint saved", path=str(final), step=step, version=version)
    return final


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[tuple[int, int], str] = {}  # (storage pointer, offset) -> first name
    out = {}
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), int(v.storage_offset()))
        out[k] = v.clone() if key in seen else v
        seen.setdefault(key, k)
    return out


def is_complete(path: Path) -> bool:
    """True iff ``path`` holds every file and each matches the COMPLETE manifest."""
    try:
        manifest = json.loads((path / "COMPLETE").read_text())
        return all(manifest.get(f) == _sha256(path / f) for f in _FILES)
    except (OSError, ValueError):
        return False


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and is_complete(p))


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """LATEST if it is complete, else the newest complete checkpoint, else None."""
    root = Path(root)
    pointer = root / "LATEST"
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
        log.warning("LATEST checkpoint is incomplete; falling back", path=str(candidate))
    found = complete_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike[str], *, restore_rng: bool = True) -> Checkpoint:
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r} is incomplete or damaged")
    state = json.loads((path / "state.json").read_text())
    if restore_rng:
        set_rng_state(load_file(str(path / "rng.safetensors")), state["rng"])
    return Checkpoint(path=path, step=int(state["step"]), version=int(state["version"]),
                      model=load_file(str(path / "model.safetensors")),
                      optimizer=_optimizer_from_flat(load_file(str(path / "optimizer.safetensors")),
                                                     state["optimizer"]),
                      extra=state["extra"])


def prune_checkpoints(root: str | os.PathLike[str], keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints and any stale tmp dirs of dead saves."""
    root = Path(root)
    for tmp in [*root.glob(".tmp-step-*"), *root.glob(".tmp-damaged-*")]:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
    done = complete_checkpoints(root)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
