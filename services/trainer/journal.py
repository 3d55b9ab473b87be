"""Step journal: the micro-batches a step consumed, kept until the step's update is checkpointed.

Acknowledging a micro-batch to the work queue hands responsibility for it to the trainer, but the
step's gradient lives in memory until the update is applied and checkpointed. Without a journal,
a core killed mid-step resumes that step without the batches it had already acknowledged. So
every consumer writes the batch here *before* acking it:

    forward -> journal.record (pending, fsync) -> ack -> ok: commit (rename) | refused: discard
                                                              -> backward

and on every step start the core replays the step's journal (after a restart: the batches the
dead process had taken), turning pending entries into committed ones first. A consumer that is
handed a batch whose id is committed here skips it (acks it, trains nothing): it was already
trained, by the replay. Entries are replayed in the order they were recorded, so a single-core
run resumes bit-for-bit. After a checkpoint of version v, the journal of steps < v is deleted.

Layout: ``<checkpoint_dir>/journal/<job_id>/step-000003/000017-<quoted batch id>.npz`` (committed)
or ``.pending.npz``; written tmp + fsync + rename. With replicas on other hosts the checkpoint
directory must be shared storage (as the checkpoints themselves must be for a core failover).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable
from typing import Any
from pathlib import Path
from urllib.parse import quote, unquote

from services.trajectory.packing import PackedBatch

_ENTRY = re.compile(r"^(\d{6})-(.+?)(\.pending)?\.npz$")


class StepJournal:
    """Thread-safe; shared by the core's training thread and (through files) by replicas."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()

    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def _entries(self, step: int) -> list[tuple[int, str, bool, Path]]:
        """(seq, batch id, pending, path) of the step's entries, in record order."""
        d = self._dir(step)
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            m = _ENTRY.match(p.name)
            if m:
                out.append((int(m.group(1)), unquote(m.group(2)), m.group(3) is not None, p))
        return sorted(out)

    def record(self, step: int, batch_id: str, batch: Any) -> Path:
        """Durably write ``batch`` (a PackedBatch: ``to_bytes()``) as a pending entry of ``step``."""
        d = self._dir(step)
        d.mkdir(parents=True, exist_ok=True)
        with self._lock:
            seq = max((e[0] for e in self._entries(step)), default=-1) + 1
            path = d / f"{seq:06d}-{quote(batch_id, safe='')}.pending.npz"
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(batch.to_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return path

    @staticmethod
    def commit(pending: Path) -> None:
        os.replace(pending, pending.with_name(pending.name.replace(".pending.npz", ".npz")))

    @staticmethod
    def discard(pending: Path) -> None:
        pending.unlink(missing_ok=True)

    def committed(self, step: int, batch_id: str) -> bool:
        return any(bid == batch_id and not pending for _s, bid, pending, _p in self._entries(step))

    def replay(self, step: int) -> list[tuple[str, PackedBatch]]:
        """Commit the step's pending entries and return every entry's batch, in record order."""
        out = []
        with self._lock:
            for _seq, batch_id, pending, path in self._entries(step):
                if pending:
                    self.commit(path)
                    path = path.with_name(path.name.replace(".pending.npz", ".npz"))
                out.append((batch_id, PackedBatch.from_bytes(path.read_bytes())))
        return out

    def forget_before(self, step: int) -> None:
        """Delete the journal of every step < ``step`` (their updates are checkpointed)."""
        if not self.root.is_dir():
            return
        for d in self.root.glob("step-*"):
            if d.name[5:].isdigit() and int(d.name[5:]) < step:
                shutil.rmtree(d, ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def journal_for(checkpoint_dir: str, job_id: str) -> StepJournal | None:
    """The job's journal, or None when the job keeps no checkpoints (nothing to resume from)."""
    return StepJournal(Path(checkpoint_dir) / "journal" / job_id) if checkpoint_dir else None


def journaled_ack(journal: StepJournal | None, step: int, batch_id: str, batch: Any,
                  ack: Callable[[], bool]) -> Callable[[], bool]:
    """The commit callback for ``Learner.train``: journal, ack, then commit or discard the entry."""
    if journal is None:
        return ack

    def commit() -> bool:
        pending = journal.record(step, batch_id, batch)
        if not ack():
            journal.discard(pending)
            return False
        journal.commit(pending)
        return True

    return commit
