"""A pool process's stdin (services/trainer/main.py): cells handed over and releases, read from a
real pipe as the core writes them."""
from __future__ import annotations

import os
import queue
import threading

from services.trainer.main import ReleaseLatch, _read_cells


class _Replica:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.interrupted = False

    def interrupt(self) -> None:
        self.interrupted = True


def _reader(lines: bytes) -> tuple[queue.Queue, ReleaseLatch, threading.Thread, int]:
    r, w = os.pipe()
    os.write(w, lines)
    cells: queue.Queue = queue.Queue()
    latch = ReleaseLatch()
    stdin = os.fdopen(r, "rb")
    t = threading.Thread(target=_read_cells, args=(stdin, cells, latch), daemon=True)
    t.start()
    return cells, latch, t, w


class _StartsAtOnce(queue.Queue):
    """The worst interleaving: the main thread starts the replica the moment a cell is handed on,
    before the reader thread runs again."""

    def __init__(self, latch: ReleaseLatch) -> None:
        super().__init__()
        self.latch = latch
        self.released_at_start: list[bool] = []

    def put(self, item, block=True, timeout=None):  # type: ignore[no-untyped-def]
        if item is not None:
            replica = _Replica(item["replica_id"])
            self.latch.started(replica)
            self.released_at_start.append(replica.interrupted)
        super().put(item, block, timeout)


def test_a_release_written_with_its_hand_over_is_latched_before_the_cell_is_handed_on() -> None:
    """The core hands a cell over and gives it back at once: both lines are in the pipe when the
    process reads. Even if the main thread starts the replica the moment it has the cell, the
    release is already latched, so the replica is interrupted as it starts (it never joins the
    step). Handed on line by line, the release came after the start: the replica joined."""
    r, w = os.pipe()
    os.write(w, b'{"cell_id": "cell-a", "replica_id": "a-s1"}\n{"release": "a-s1"}\n')
    latch = ReleaseLatch()
    cells = _StartsAtOnce(latch)
    t = threading.Thread(target=_read_cells, args=(os.fdopen(r, "rb"), cells, latch), daemon=True)
    t.start()
    assert cells.get(timeout=10) == {"cell_id": "cell-a", "replica_id": "a-s1"}
    assert cells.released_at_start == [True]
    os.close(w)
    assert cells.get(timeout=10) is None
    t.join(10)


def test_cells_in_order_then_none_at_the_end_and_a_later_release_reaches_the_running_replica() -> None:
    cells, latch, t, w = _reader(b'{"cell_id": "c1", "replica_id": "r1"}\n\n{"cell_id": "c2", "replica_id": "r2"}')
    assert cells.get(timeout=10)["replica_id"] == "r1"
    first = _Replica("r1")
    latch.started(first)
    assert not first.interrupted
    os.write(w, b'\n{"release": "r1"}\n')  # completes r2's line, then gives r1's cell back
    assert cells.get(timeout=10)["replica_id"] == "r2"
    os.close(w)
    assert cells.get(timeout=10) is None  # end of stdin: the core retires the process
    t.join(10)
    assert first.interrupted  # applied to the replica already running


def test_a_line_that_does_not_parse_ends_the_reader() -> None:
    cells, _, t, w = _reader(b'{"cell_id": "c1", "replica_id": "r1"}\nnot json\n{"cell_id": "c2", "replica_id": "r2"}\n')
    assert cells.get(timeout=10)["replica_id"] == "r1"
    assert cells.get(timeout=10) is None
    t.join(10)
    os.close(w)
