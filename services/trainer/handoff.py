"""A leaving replica's gradient sum handed to the core through shared memory, when both share one.

A replica given back mid-step hands its gradient sum to the core (``HandOffGradients``). Streamed
over gRPC, the sum of a 135M-parameter model (~540 MB) is copied about eight times on its way
(tensor -> bytes -> message -> socket -> message -> bytes -> tensor), and the cell waits for all of
it. When the replica can write into the core's shared-memory folder, it writes each tensor once into
a file there and sends only the file's name and layout (``HandOffSharedGradients``); the core maps
the file (no copy), unlinks it and adds it to its gradient at the step's end.

A full ``/dev/shm`` (a container's default is 64 MiB: give the trainer's ``shm_size``) makes the
replica stream instead; it never fails the hand-off.

Who may use it: the core makes a private folder (mode 0700) under ``/dev/shm`` and puts a random
token file in it; the JoinStep ticket carries the folder and the token. A replica that reads the same
token there shares the core's filesystem (same host, same mount namespace, same user); any other
(another host, another container, no ``/dev/shm``) streams as before. The core only opens a plain
file name inside its own folder, never a path a client chose.

Lifecycle: ``SharedHandoff()`` (the core, once per process) -> ``take()`` per hand-off -> ``close()``
at exit. Folders left by a core that was killed are removed by the next core on the host
(``_sweep``: the folder names carry the owner's pid).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import InvalidArgument
from services.common.logging import get_logger

log = get_logger(__name__)

SHM_ROOT = Path("/dev/shm")
PREFIX = "gyre-handoff-"
TOKEN_FILE = ".token"
ALIGN = 64  # every tensor starts at a multiple of this (any dtype's alignment)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies in a hand-off file."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset_bytes: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if name and not name.startswith("_") else None
    if not isinstance(dt, torch.dtype):
        raise InvalidArgument(f"hand-off tensor dtype {name!r} is not a torch dtype")
    return dt


def layout(state: Mapping[str, torch.Tensor]) -> tuple[list[TensorRef], int]:
    """Each tensor's place in a hand-off file, and the file's size."""
    refs, at = [], 0
    for name, t in state.items():
        refs.append(TensorRef(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                              offset_bytes=at))
        at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return refs, at


class SharedHandoff:
    """The core's side: a private shared-memory folder, and the files replicas write into it."""

    def __init__(self, root: Path = SHM_ROOT) -> None:
        _sweep(root)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))  # mode 0700
        self.token = secrets.token_hex(16)
        (self.dir / TOKEN_FILE).write_text(self.token)

    @classmethod
    def open(cls, root: Path = SHM_ROOT) -> SharedHandoff | None:
        """The folder, or None where the host has no writable shared memory (replicas then stream)."""
        try:
            return cls(root)
        except OSError as exc:
            log.info("no shared-memory gradient hand-off; replicas stream theirs", root=str(root), error=str(exc))
            return None

    def take(self, file: str, refs: list[TensorRef]) -> dict[str, torch.Tensor]:
        """The tensors of hand-off file ``file`` (a name in this folder), mapped, not copied; the file
        is unlinked whatever happens (its pages live on in the mapping until the tensors are dropped).
        InvalidArgument when the name, the file or the layout is not what a replica writes."""
        if not _NAME.fullmatch(file) or file == TOKEN_FILE:
            raise InvalidArgument(f"hand-off file {file!r} is not a plain file name")
        path = self.dir / file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidArgument(f"hand-off file {file!r} cannot be opened in the core's shared-memory folder: "
                                  f"{exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"hand-off file {file!r} is not a regular file")
            size = st.st_size
            end = 0
            for r in refs:
                if r.offset_bytes < end or r.offset_bytes % ALIGN or any(d < 0 for d in r.shape):
                    raise InvalidArgument(f"hand-off tensor {r.name!r} overlaps another or is misaligned")
                end = r.offset_bytes + r.nbytes
            if end > size:
                raise InvalidArgument(f"hand-off file {file!r} holds {size} bytes; its tensors need {end}")
            buf = (torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8) if size
                   else torch.empty(0, dtype=torch.uint8))
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        return {r.name: buf[r.offset_bytes:r.offset_bytes + r.nbytes].view(_dtype(r.dtype)).reshape(r.shape)
                for r in refs}

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def write(folder: str, token: str, name: str, state: Mapping[str, torch.Tensor]) -> tuple[str, list[TensorRef]] | None:
    """The replica's side: ``state`` written once into a file of the core's folder, as (file name,
    layout); None when this process does not share that folder (the caller streams instead)."""
    if not folder or not token:
        return None
    base = Path(folder)
    try:
        if (base / TOKEN_FILE).read_text() != token:
            return None
    except OSError:
        return None
    file = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:180] + f"-{os.getpid()}-{secrets.token_hex(4)}.grad"
    refs, size = layout(state)
    path = base / file
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        if size:
            # reserve the pages now: a full tmpfs (a container's 64 MiB /dev/shm) fails here, with
            # ENOSPC, instead of killing this process with SIGBUS when a mapped page is first written
            os.posix_fallocate(fd, 0, size)
            out = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            for r, t in zip(refs, state.values()):
                if t.numel():
                    dst = out[r.offset_bytes:r.offset_bytes + r.nbytes].view(t.dtype).reshape(t.shape)
                    dst.copy_(t.detach())
            del out
    except (OSError, RuntimeError):
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(fd)
    return file, refs


def discard(folder: str, file: str) -> None:
    """Remove a hand-off file the core did not take (the hand-off was refused)."""
    if folder and _NAME.fullmatch(file):
        (Path(folder) / file).unlink(missing_ok=True)


def _sweep(root: Path) -> None:
    """Remove the folders of cores on this host whose process is gone (killed, so never closed)."""
    try:
        entries = list(root.glob(f"{PREFIX}*"))
    except OSError:
        return
    for d in entries:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-.*", d.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            if d.stat().st_uid != os.getuid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue
