"""Workspace snapshots are untrusted: path escapes, size limits, symlinks and archives."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from services.reward.workspace import (
    WorkspaceLimits,
    WorkspaceRejected,
    materialize,
    pack,
    snapshot_dir,
    unpack,
    validate_files,
)

LIMITS = WorkspaceLimits(max_files=8, max_file_bytes=64, max_total_bytes=128, max_path_chars=40, max_depth=4)


@pytest.mark.parametrize(
    "path",
    ["../etc/passwd", "a/../../b", "/etc/passwd", "a/./b", "a//b", "C:/x", "a\\b", "..", ".", "", "a/b/",
     "a\x00b", "a\nb", "\u00e9t\u00e9"],
)
def test_escaping_or_odd_paths_are_refused(path: str) -> None:
    with pytest.raises(WorkspaceRejected):
        validate_files({path: b"x"}, LIMITS)


def test_good_paths_pass_and_come_back_unchanged() -> None:
    files = {"src/m1.gs": b"x 1 +", "README.md": b"hi", "a/b/c.txt": b""}
    assert validate_files(files, LIMITS) == files


def test_size_limits() -> None:
    with pytest.raises(WorkspaceRejected, match="65 bytes"):
        validate_files({"a": b"x" * 65}, LIMITS)
    with pytest.raises(WorkspaceRejected, match="in total"):
        validate_files({f"f{i}": b"x" * 60 for i in range(3)}, LIMITS)
    with pytest.raises(WorkspaceRejected, match="9 files"):
        validate_files({f"f{i}": b"" for i in range(9)}, LIMITS)
    with pytest.raises(WorkspaceRejected, match="longer than"):
        validate_files({"a" * 41: b""}, LIMITS)
    with pytest.raises(WorkspaceRejected, match="deeper"):
        validate_files({"a/b/c/d/e": b""}, LIMITS)


def test_file_and_directory_clash_is_refused() -> None:
    with pytest.raises(WorkspaceRejected, match="both a file and a directory"):
        validate_files({"a": b"1", "a/b": b"2"}, LIMITS)


def test_pack_unpack_round_trip_is_deterministic() -> None:
    files = {"src/m2.gs": b"x 2 *", "src/m1.gs": b"x 1 +"}
    blob = pack(files)
    assert blob == pack(dict(reversed(list(files.items()))))
    assert unpack(blob, LIMITS) == files


def _zip(entries: dict[str, bytes]) -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_unpack_refuses_zip_slip_and_bombs() -> None:
    with pytest.raises(WorkspaceRejected):
        unpack(_zip({"../evil": b"x"}), LIMITS)
    with pytest.raises(WorkspaceRejected, match="too large"):
        unpack(_zip({"bomb": b"\0" * 10_000}), LIMITS)  # compresses to a few bytes
    with pytest.raises(WorkspaceRejected, match="corrupt"):
        unpack(b"not a zip", LIMITS)


def test_materialize_writes_inside_root_only(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    materialize({"src/m1.gs": b"x 1 +", "top": b"t"}, root, LIMITS)
    assert (root / "src" / "m1.gs").read_bytes() == b"x 1 +"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ws"]


def test_materialize_does_not_follow_a_planted_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ws"
    root.mkdir()
    # The link sits where a directory of the snapshot goes: refused (the root is not empty, and
    # every directory is entered with O_NOFOLLOW), nothing lands outside.
    os.symlink(outside, root / "src")
    with pytest.raises(WorkspaceRejected):
        materialize({"src/m1.gs": b"pwned"}, root, LIMITS)
    assert list(outside.iterdir()) == []


def test_materialize_refuses_a_symlinked_root(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with pytest.raises(OSError):
        materialize({"a": b"1"}, tmp_path / "link", LIMITS)
    assert list(real.iterdir()) == []


def test_snapshot_dir_refuses_symlinks(tmp_path: Path) -> None:
    (tmp_path / "ws" / "src").mkdir(parents=True)
    (tmp_path / "ws" / "src" / "m1.gs").write_text("x 1 +")
    assert snapshot_dir(tmp_path / "ws", LIMITS) == {"src/m1.gs": b"x 1 +"}
    (tmp_path / "secret").write_text("top secret")
    os.symlink(tmp_path / "secret", tmp_path / "ws" / "src" / "m2.gs")
    with pytest.raises(WorkspaceRejected, match="symlink"):
        snapshot_dir(tmp_path / "ws", LIMITS)
    os.unlink(tmp_path / "ws" / "src" / "m2.gs")
    os.symlink(tmp_path, tmp_path / "ws" / "up")
    with pytest.raises(WorkspaceRejected, match="symlink"):
        snapshot_dir(tmp_path / "ws", LIMITS)
