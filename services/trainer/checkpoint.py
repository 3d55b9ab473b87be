"""Atomic, exactly-resumable trainer checkpoints, in torch Distributed Checkpoint (DCP) format.

Layout under ``root``:

    step-000004/                 one complete checkpoint (after the update of step 3 -> version 4)
        state/                   a DCP folder: {"model": ..., "optimizer": ...} keyed by parameter
                                 name; written by every rank of a sharded group (one file each) or
                                 by one process, and loadable at any number of ranks (resharded)
        state.json               step, version, python RNG, job info
        rng.safetensors          torch (+ CUDA) RNG states, numpy's as uint32 words
        COMPLETE                 written last, holds the sha256 of every other file
    LATEST                       name of the newest complete checkpoint (replaced atomically)

A save writes everything into ``.tmp-step-000004-<pid>/``, fsyncs each file, renames the
directory into place (atomic on POSIX) and then replaces LATEST via rename. A crash at any
point leaves either the previous checkpoint or the new one - never a torn one: ``latest_checkpoint``
only accepts a directory whose COMPLETE manifest matches its files, and falls back to the newest
older complete checkpoint when LATEST points at something missing or damaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from services.common.logging import get_logger

log = get_logger(__name__)

_REQUIRED = ("state/.metadata", "rng.safetensors", "state.json")
_STATE = "state"  # the DCP folder


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint's record (its tensors stay on disk: ``load_into``, ``load_weights``)."""

    path: Path
    step: int            # the next step to train
    version: int         # weight version of its model
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


def _files(path: Path) -> list[str]:
    """Every file under a checkpoint directory but its COMPLETE manifest, as relative paths."""
    return sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != "COMPLETE")


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns that it saves/loads in one process when no process group exists: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, distributed: bool) -> None:
    """Write the model's and optimizer's state as a DCP folder ``path``; ``distributed``: every rank
    of the (sharded) process group calls this, each writing its shards."""
    import torch.distributed.checkpoint as dcp

    with _quiet_dcp():
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(path), no_dist=not distributed)


def save_checkpoint(root: str | os.PathLike[str], *, step: int, version: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None,
                    write_state: Callable[[Path], None] | None = None) -> Path:
    """Atomically write a checkpoint named after ``version``; returns its directory.
    ``write_state(dir)``: writes the DCP folder (a sharded group's ranks together); default: this
    process writes ``model`` and ``optimizer`` whole."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{version:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    final = root / name
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if write_state is not None:
        write_state(tmp / _STATE)
    else:
        save_state(tmp / _STATE, model, optimizer, distributed=False)
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    state = {"step": step, "version": version, "rng": rng_meta, "extra": extra or {}}
    (tmp / "state.json").write_text(json.dumps(state))
    files = _files(tmp)
    for f in files:
        _fsync_file(tmp / f)
    manifest = {f: _sha256(tmp / f) for f in files}
    (tmp / "COMPLETE").write_text(json.dumps(manifest))
    _fsync_file(tmp / "COMPLETE")
    _fsync_dir(tmp / _STATE)
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


def is_complete(path: Path) -> bool:
    """True iff ``path`` holds every file of its COMPLETE manifest (the required ones among them),
    each matching its hash, and no other."""
    try:
        manifest = json.loads((path / "COMPLETE").read_text())
        return (all(f in manifest for f in _REQUIRED) and sorted(manifest) == _files(path)
                and all(manifest[f] == _sha256(path / f) for f in manifest))
    except (OSError, ValueError, TypeError):
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
    """A complete checkpoint's record (and this process's RNG restored from it)."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r} is incomplete or damaged")
    state = json.loads((path / "state.json").read_text())
    if restore_rng:
        set_rng_state(load_file(str(path / "rng.safetensors")), state["rng"])
    return Checkpoint(path=path, step=int(state["step"]), version=int(state["version"]), extra=state["extra"])


def _saved_model(path: Path) -> dict[str, Any]:
    """name -> saved tensor metadata of the checkpoint's model weights."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path / _STATE)).read_metadata().state_dict_metadata
    return {k[len("model."):]: v for k, v in meta.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def check_model(path: str | os.PathLike[str], model: torch.nn.Module) -> None:
    """Refuse, in one sentence, a checkpoint of another model than ``model`` (names and shapes)."""
    saved = {k: tuple(v.size) for k, v in _saved_model(Path(path)).items()}
    have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if saved == have:
        return
    missing, extra = sorted(set(have) - set(saved)), sorted(set(saved) - set(have))
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"holds {extra[0]!r}, which this model has not"
    else:
        name = next(k for k in sorted(have) if saved[k] != have[k])
        what = f"holds {name!r} of shape {list(saved[name])}, this model's is {list(have[name])}"
    raise ValueError(f"checkpoint {str(path)!r} is of another model: it {what}")


def load_into(path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
              distributed: bool = False) -> None:
    """Load a checkpoint's model and optimizer state into ``model`` and ``optimizer``, whatever the
    number of ranks that saved it (``distributed``: every rank of a sharded group calls this)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, optimizer)
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(Path(path) / _STATE), no_dist=not distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's whole model weights on CPU (whatever number of ranks saved them)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r} is incomplete or damaged")
    weights = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in _saved_model(path).items()}
    with _quiet_dcp():
        dcp.load({"model": weights}, checkpoint_id=str(path / _STATE), no_dist=True)
    return weights


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
