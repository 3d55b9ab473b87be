"""Step journal: batches are journaled before their ack, replayed in order, skipped once trained."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.common.logging import get_logger
from services.trainer.journal import StepJournal, journaled_ack
from services.trainer.sources import Delivery, train_delivery
from services.trainer.synthetic import make_step
from services.trajectory.packing import PackedBatch


@pytest.fixture(scope="module")
def batches() -> list[PackedBatch]:
    return make_step(0, num_executions=3, micro_batch_tokens=60, step=2).batches


def test_record_commit_discard_and_ordered_replay(tmp_path: Path, batches: list[PackedBatch]) -> None:
    j = StepJournal(tmp_path)
    ids = ["2/b", "2/a", "odd/id with spaces"]
    paths = [j.record(2, i, b) for i, b in zip(ids, batches)]
    assert all(p.name.endswith(".pending.npz") for p in paths)
    assert not j.committed(2, "2/b")
    j.commit(paths[0])
    j.discard(paths[1])
    assert j.committed(2, "2/b") and not j.committed(2, "2/a")
    replayed = j.replay(2)                      # commits the remaining pending entry
    assert [bid for bid, _ in replayed] == ["2/b", "odd/id with spaces"]  # record order, not name order
    np.testing.assert_array_equal(replayed[1][1].input_ids, batches[2].input_ids)
    assert j.committed(2, "odd/id with spaces")
    j.record(5, "x", batches[0])
    j.forget_before(5)
    assert j.replay(2) == [] and len(j.replay(5)) == 1


def test_refused_ack_leaves_no_entry(tmp_path: Path, batches: list[PackedBatch]) -> None:
    j = StepJournal(tmp_path)
    assert not journaled_ack(j, 2, "b0", batches[0], lambda: False)()
    assert j.replay(2) == []
    assert journaled_ack(j, 2, "b1", batches[1], lambda: True)()
    assert j.committed(2, "b1")


class _Learner:
    def __init__(self) -> None:
        self.trained: list[int] = []

    def train(self, batch: PackedBatch, commit=None) -> bool:  # noqa: ANN001 - test double of Learner.train's contract
        if commit is not None and not commit():
            return False
        self.trained.append(len(batch.input_ids))
        return True


def test_consumers_skip_batches_the_journal_already_holds(tmp_path: Path, batches: list[PackedBatch]) -> None:
    j = StepJournal(tmp_path)
    j.commit(j.record(2, "2/0", batches[0]))    # trained before a restart, replayed by the core
    acks: list[str] = []

    def delivery(i: int) -> Delivery:
        return Delivery(batch=batches[i], ack=lambda: acks.append(f"2/{i}") is None, reject=lambda _w: None,
                        batch_id=f"2/{i}")

    learner = _Learner()
    log = get_logger("test")
    assert not train_delivery(learner, delivery(0), step=2, journal=j, log=log)  # acked, not retrained
    assert train_delivery(learner, delivery(1), step=2, journal=j, log=log)
    assert acks == ["2/0", "2/1"] and learner.trained == [len(batches[1].input_ids)]
    assert j.committed(2, "2/1")
