"""The shared-memory gradient hand-off: what a replica writes is what the core takes, bit for bit;
only a process that shares the core's folder uses it; the core opens nothing but plain files of its
own folder and leaves none behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidArgument
from services.trainer import handoff
from services.trainer.handoff import PREFIX, SharedHandoff, TensorRef


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(7, 5, generator=g), "norm.weight": torch.randn(3, generator=g),
            "empty": torch.zeros(0), "__stats__": torch.arange(6, dtype=torch.float64),
            "head.bias": torch.randn(1, dtype=torch.bfloat16, generator=g)}


def test_what_a_replica_writes_the_core_takes_bit_for_bit(tmp_path: Path) -> None:
    core = SharedHandoff(tmp_path)
    try:
        assert oct(core.dir.stat().st_mode & 0o777) == "0o700"
        state = _state()
        written = handoff.write(str(core.dir), core.token, "cell-1/rep 2", state)
        assert written is not None
        file, refs = written
        assert "/" not in file and " " not in file and all(r.offset_bytes % handoff.ALIGN == 0 for r in refs)
        got = core.take(file, refs)
        assert list(got) == list(state)
        for name, t in state.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        # the file is gone once taken (the tensors live on in the mapping)
        assert sorted(p.name for p in core.dir.iterdir()) == [handoff.TOKEN_FILE]
        assert float(got["embed.weight"].sum()) == pytest.approx(float(state["embed.weight"].sum()))
    finally:
        core.close()
    assert not core.dir.exists()


def test_only_a_process_that_reads_the_cores_token_writes_there(tmp_path: Path) -> None:
    core = SharedHandoff(tmp_path)
    try:
        state = _state()
        assert handoff.write(str(core.dir), "another-core", "r", state) is None  # another filesystem's folder
        assert handoff.write(str(tmp_path / "missing"), core.token, "r", state) is None
        assert handoff.write("", "", "r", state) is None  # the core offers none
        assert sorted(p.name for p in core.dir.iterdir()) == [handoff.TOKEN_FILE]
    finally:
        core.close()


def test_the_core_refuses_what_a_replica_does_not_write(tmp_path: Path) -> None:
    core = SharedHandoff(tmp_path)
    try:
        secret = tmp_path / "secret"
        secret.write_bytes(b"\0" * 64)
        ref = [TensorRef(name="w", dtype="float32", shape=(4,), offset_bytes=0)]
        for bad in ("../secret", str(secret), handoff.TOKEN_FILE, "", "a/b"):
            with pytest.raises(InvalidArgument, match="not a plain file name"):
                core.take(bad, ref)
        (core.dir / "link").symlink_to(secret)
        with pytest.raises(InvalidArgument, match="cannot be opened"):
            core.take("link", ref)
        with pytest.raises(InvalidArgument, match="cannot be opened"):
            core.take("never-written", ref)
        written = handoff.write(str(core.dir), core.token, "r", {"w": torch.ones(4)})
        assert written is not None
        with pytest.raises(InvalidArgument, match="need"):  # a layout past the file's end
            core.take(written[0], [TensorRef(name="w", dtype="float32", shape=(400,), offset_bytes=0)])
        written = handoff.write(str(core.dir), core.token, "r", {"w": torch.ones(4)})
        assert written is not None
        with pytest.raises(InvalidArgument, match="not a torch dtype"):
            core.take(written[0], [TensorRef(name="w", dtype="Tensor", shape=(4,), offset_bytes=0)])
        assert sorted(p.name for p in core.dir.iterdir()) == [handoff.TOKEN_FILE, "link"]  # refused files unlinked too
        assert secret.read_bytes() == b"\0" * 64
    finally:
        core.close()


def test_a_killed_cores_folder_is_swept_by_the_next(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale = tmp_path / f"{PREFIX}{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "x.grad").write_bytes(b"1")
    alive = tmp_path / f"{PREFIX}{os.getppid()}-def"  # a live process's: kept
    alive.mkdir()
    core = SharedHandoff(tmp_path)
    try:
        assert not stale.exists() and alive.exists()
    finally:
        core.close()


def test_a_full_shared_memory_makes_the_replica_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's small /dev/shm: reserving the file's pages fails with ENOSPC; the replica is
    told to stream (None) and leaves no file behind, instead of dying of SIGBUS on a mapped page."""
    import errno

    core = SharedHandoff(tmp_path)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        assert handoff.write(str(core.dir), core.token, "r", _state()) is None
        assert sorted(p.name for p in core.dir.iterdir()) == [handoff.TOKEN_FILE]
    finally:
        core.close()
