"""Workspace snapshots as untrusted data: validation, a compact archive format, safe materializing.

A workspace is a mapping ``relative path -> bytes`` sent by a harness. Nothing in it is trusted:

* paths must be relative, normalized POSIX paths: no absolute paths, no ``..`` / ``.`` / empty
  segments, no backslashes, NUL or control characters, no drive letters, bounded length and
  depth; a path may not be both a file and a directory (``a`` and ``a/b``);
* size limits: number of files, bytes per file, bytes in total;
* `materialize` writes into a fresh directory with ``O_NOFOLLOW | O_EXCL`` and refuses to pass
  through any symlink, so even a pre-planted link cannot redirect a write outside the root;
* `snapshot_dir` (harness side) reads a directory tree and refuses symlinks and special files.

Archives are zip files (deflate) whose entry names go through the same validation on the way back.
"""

from __future__ import annotations

import io
import os
import re
import stat
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "WorkspaceLimits",
    "WorkspaceRejected",
    "validate_path",
    "validate_files",
    "pack",
    "unpack",
    "materialize",
    "snapshot_dir",
]

_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=@,-]*$")


class WorkspaceRejected(ValueError):
    """A snapshot breaks a safety rule; `reason` is a short tag for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class WorkspaceLimits:
    """Bounds on one workspace snapshot."""

    max_files: int = 1024
    """Files in one snapshot."""
    max_file_bytes: int = 1 << 20
    """Bytes in one file."""
    max_total_bytes: int = 16 << 20
    """Bytes in all files together (uncompressed)."""
    max_path_chars: int = 256
    """Characters in one path."""
    max_depth: int = 16
    """Directory levels in one path."""

    def __post_init__(self) -> None:
        for name in ("max_files", "max_file_bytes", "max_total_bytes", "max_path_chars", "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkspaceLimits.{name} must be >= 1, got {getattr(self, name)}.")


def validate_path(path: str, limits: WorkspaceLimits) -> str:
    """Return `path` if it is a safe relative path inside the workspace, else raise."""
    if not isinstance(path, str) or not path:
        raise WorkspaceRejected("path", "workspace path is empty")
    shown = path[:80]
    if len(path) > limits.max_path_chars:
        raise WorkspaceRejected("path", f"workspace path {shown!r}... is longer than {limits.max_path_chars} chars")
    if path.startswith("/") or "\\" in path or (len(path) > 1 and path[1] == ":"):
        raise WorkspaceRejected("escape", f"workspace path {shown!r} is absolute; paths must be relative")
    segments = path.split("/")
    if len(segments) > limits.max_depth:
        raise WorkspaceRejected("path", f"workspace path {shown!r} is deeper than {limits.max_depth} levels")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise WorkspaceRejected("escape", f"workspace path {shown!r} has a '{seg}' segment; use normalized paths")
        if not _SEGMENT_RE.match(seg):
            raise WorkspaceRejected("path", f"workspace path {shown!r} has characters outside [A-Za-z0-9._+=@,-]")
    return path


def validate_files(files: Mapping[str, bytes], limits: WorkspaceLimits) -> dict[str, bytes]:
    """Check a whole snapshot (paths, counts, sizes, file/dir clashes); returns a plain dict copy."""
    if len(files) > limits.max_files:
        raise WorkspaceRejected("size", f"workspace has {len(files)} files; the limit is {limits.max_files}")
    total = 0
    out: dict[str, bytes] = {}
    for path, data in files.items():
        validate_path(path, limits)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WorkspaceRejected("path", f"workspace file {path[:80]!r} is not bytes")
        if len(data) > limits.max_file_bytes:
            raise WorkspaceRejected(
                "size", f"workspace file {path[:80]!r} has {len(data)} bytes; the limit is {limits.max_file_bytes}"
            )
        total += len(data)
        if total > limits.max_total_bytes:
            raise WorkspaceRejected("size", f"workspace exceeds {limits.max_total_bytes} bytes in total")
        out[path] = bytes(data)
    dirs = {"/".join(p.split("/")[:i]) for p in out for i in range(1, p.count("/") + 1)}
    clash = dirs & out.keys()
    if clash:
        raise WorkspaceRejected("path", f"workspace path {sorted(clash)[0][:80]!r} is both a file and a directory")
    return out


def pack(files: Mapping[str, bytes]) -> bytes:
    """A deterministic zip of already validated files (sorted, fixed timestamps)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for path in sorted(files):
            info = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[path])
    return buf.getvalue()


def unpack(blob: bytes, limits: WorkspaceLimits) -> dict[str, bytes]:
    """Files of an archive made by `pack`, validated again (sizes checked before decompressing)."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(blob))
    except zipfile.BadZipFile as exc:
        raise WorkspaceRejected("archive", f"workspace archive is corrupt: {exc}") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_files:
            raise WorkspaceRejected("size", f"workspace has {len(infos)} files; the limit is {limits.max_files}")
        files: dict[str, bytes] = {}
        for info in infos:
            validate_path(info.filename, limits)
            if info.file_size > limits.max_file_bytes:
                raise WorkspaceRejected("size", f"workspace file {info.filename[:80]!r} is too large")
            with zf.open(info) as fh:
                data = fh.read(limits.max_file_bytes + 1)  # never trust the declared size alone
            if len(data) > limits.max_file_bytes:
                raise WorkspaceRejected("size", f"workspace file {info.filename[:80]!r} is too large")
            files[info.filename] = data
    return validate_files(files, limits)


def materialize(files: Mapping[str, bytes], root: str | os.PathLike[str], limits: WorkspaceLimits) -> Path:
    """Write a snapshot under `root` (which must be an empty real directory); returns `root`.

    Every directory is created and entered with ``O_NOFOLLOW`` relative to the previous one's
    file descriptor, so no symlink (planted or racing) can move a write outside `root`.
    """
    checked = validate_files(files, limits)
    base = Path(root)
    root_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if os.listdir(root_fd):
            raise WorkspaceRejected("escape", f"materialize target {str(base)!r} is not empty")
        for path, data in checked.items():
            *dirs, name = path.split("/")
            fd = os.dup(root_fd)
            try:
                for d in dirs:
                    try:
                        os.mkdir(d, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    try:
                        nxt = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    except OSError:
                        raise WorkspaceRejected("escape", f"workspace path {path[:80]!r} passes through a symlink") from None
                    os.close(fd)
                    fd = nxt
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                try:
                    out = os.open(name, flags, 0o600, dir_fd=fd)
                except FileExistsError:
                    raise WorkspaceRejected("escape", f"workspace path {path[:80]!r} already exists") from None
                with os.fdopen(out, "wb") as fh:
                    fh.write(data)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return base


def snapshot_dir(root: str | os.PathLike[str], limits: WorkspaceLimits) -> dict[str, bytes]:
    """Read a workspace directory (harness side); symlinks and special files are refused."""
    base = Path(root)
    files: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        for name in list(dirnames) + filenames:
            full = Path(dirpath) / name
            st = os.lstat(full)
            rel = full.relative_to(base).as_posix()
            if stat.S_ISLNK(st.st_mode):
                raise WorkspaceRejected("escape", f"workspace entry {rel[:80]!r} is a symlink")
            if name in filenames:
                if not stat.S_ISREG(st.st_mode):
                    raise WorkspaceRejected("path", f"workspace entry {rel[:80]!r} is not a regular file")
                validate_path(rel, limits)
                if st.st_size > limits.max_file_bytes:
                    raise WorkspaceRejected("size", f"workspace file {rel[:80]!r} is too large")
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as fh:
                    files[rel] = fh.read(limits.max_file_bytes + 1)
                if len(files) > limits.max_files:
                    raise WorkspaceRejected("size", f"workspace has more than {limits.max_files} files")
    return validate_files(files, limits)
