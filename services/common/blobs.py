"""Blob spool: large payloads (token arrays, weights, workspaces, KV) live on disk, not in Redis.

Redis holds only the key (and size/hash); the bytes are files under ``root``. Writes are atomic
(write a temp file in the same directory, fsync, rename), so a reader never sees a torn blob and a
crash mid-write leaves at most a stray ``.tmp`` file that ``sweep_tmp`` removes.

Arrays are stored as ``.npy`` (header + raw buffer), so a 1M-token array loads with one read and
can be memory-mapped.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from pathlib import Path

import numpy as np

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,511}$")


class BlobStore:
    """Content under ``root``, addressed by slash-separated keys (no ``..``, no absolute paths)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if not _KEY.match(key) or ".." in key.split("/") or "//" in key:
            raise ValueError(f"blob key {key!r} is invalid: use letters, digits, '._-/' and no '..'")
        return self.root / key

    def put(self, key: str, data: bytes | memoryview) -> str:
        """Store ``data`` atomically under ``key``; returns its sha256 hex digest."""
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return hashlib.sha256(data).hexdigest()

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(f"blob {key!r} not found in spool {self.root}") from None

    def put_array(self, key: str, array: np.ndarray) -> int:
        """Store ``array`` as .npy; returns the number of bytes written."""
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
        view = buf.getbuffer()
        self.put(key, view)
        return len(view)

    def get_array(self, key: str, *, mmap: bool = False) -> np.ndarray:
        path = self.path(key)
        if not path.exists():
            raise KeyError(f"blob {key!r} not found in spool {self.root}")
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def sweep_tmp(self) -> int:
        """Remove temp files left by a crash mid-write; returns how many were removed."""
        removed = 0
        for tmp in self.root.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)
            removed += 1
        return removed
