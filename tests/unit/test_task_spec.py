"""The XLong task family: deterministic generation, ids, splits, reference solutions, scoring."""

from __future__ import annotations

from collections import Counter

import pytest

from services.task.scoring import score_workspace
from services.task.spec import TaskParams, step_code, task_from_id, task_generator, task_ids


def test_tasks_are_pure_functions_of_their_id() -> None:
    params = TaskParams(num_modules=6, max_ops=4, call_pct=60, visible_tests=3, hidden_tests=3)
    for tid in task_ids(20, params=params) + task_ids(5, split="heldout", params=params):
        a, b = task_from_id(tid), task_from_id(tid)
        assert a == b and a.task_id == tid
        assert len(a.modules) == 6 and all(len(m.tests) == 6 for m in a.modules)


def test_splits_differ() -> None:
    train = {task_from_id(t).to_json().split('"split"')[0] for t in task_ids(30)}
    held = {task_from_id(t).to_json().split('"split"')[0] for t in task_ids(30, split="heldout")}
    assert not train & held


def test_reference_solutions_pass_every_test_and_wrong_order_fails() -> None:
    for tid in task_ids(30, params=TaskParams(call_pct=50)):
        task = task_from_id(tid)
        files = {task.module_path(m.name): m.reference_code.encode() for m in task.modules}
        score = score_workspace(task, files)
        assert score.all_passed and score.reward == 1.0
    # A `sub c` step written as `c swap -` computes c - value: the tests notice.
    task = next(
        t for t in map(task_from_id, task_ids(200))
        if any(s.startswith("sub ") for s in t.modules[0].steps) and not t.modules[0].calls
    )
    m = task.modules[0]
    wrong = " ".join(step_code(s).replace(" -", " swap -") if s.startswith("sub ") else step_code(s) for s in m.steps)
    files = {task.module_path(m.name): wrong.encode()}
    assert score_workspace(task, files).modules[0].passed < len(m.tests)


def test_step_code() -> None:
    assert step_code("x") == "x"
    assert step_code("m3 ( x )") == "x m3"
    assert step_code("sub 4") == "4 -"
    assert step_code("rsub 4") == "4 swap -"
    assert step_code("mul 4") == "4 *"
    assert step_code("add 4") == "4 +"
    for bad in ("div 4", "sub", "sub x", "_ - 4"):
        with pytest.raises(ValueError):
            step_code(bad)


def test_bad_ids_and_knobs_are_refused() -> None:
    for bad in ("", "xlong-v1/train/1", "xlong-v1/dev/1/m4.s1-3.c30.t2.h2", "../../etc", "xlong-v1/train/1/m0.s1-3.c30.t2.h2"):
        with pytest.raises(ValueError):
            task_from_id(bad)
    with pytest.raises(ValueError):
        TaskParams(min_ops=3, max_ops=2)
    with pytest.raises(ValueError):
        TaskParams(visible_tests=6, hidden_tests=6)


def test_scoring_partial_credit_and_untrusted_files() -> None:
    task = task_from_id(task_ids(1)[0])
    ref = {task.module_path(m.name): m.reference_code.encode() for m in task.modules}
    first_only = {task.module_path(task.modules[0].name): ref[task.module_path(task.modules[0].name)]}
    s = score_workspace(task, first_only)
    assert 0 < s.reward < 1 and s.modules[0].ok
    assert [m.error for m in s.modules[1:]] == ["missing"] * (len(task.modules) - 1)
    garbage = {**ref, task.module_path("m1"): b"\xff\xfe", "src/evil.gs": b"x"}
    s = score_workspace(task, garbage)
    assert s.modules[0].error == "missing" and not s.all_passed
    s = score_workspace(task, {**ref, task.module_path("m1"): b"x " * 5000})
    assert s.modules[0].passed == 0


def test_reward_discounts_modules_by_recorded_attempts() -> None:
    task = task_from_id(task_ids(1, params=TaskParams(num_modules=2, call_pct=0))[0])
    ref = {task.module_path(m.name): m.reference_code.encode() for m in task.modules}
    assert score_workspace(task, ref).reward == 1.0  # no attempts file: first try assumed
    took = {**ref, "harness/attempts.json": b'{"m1": 1, "m2": 3}'}
    s = score_workspace(task, took)
    assert s.all_passed and s.tests_fraction == 1.0 and s.reward == pytest.approx((1 + 0.25) / 2)
    assert score_workspace(task, took, discount=1.0).reward == 1.0
    for junk in (b"[1]", b"{", b'{"m1": -4, "m2": "x"}', b'{"m1": true}'):
        assert score_workspace(task, {**ref, "harness/attempts.json": junk}).reward == 1.0


def test_a_heavy_tail_of_long_tasks() -> None:
    params = TaskParams(num_modules=10, long_pct=15, long_modules=30)
    ids = task_ids(400, params=params)
    assert ids[0] == "xlong-v1/train/0/m10.s1-3.c30.t2.h2.l15x30"
    tasks = [task_from_id(t) for t in ids]
    sizes = Counter(len(t.modules) for t in tasks)
    assert set(sizes) == {10, 30} and 0.10 <= sizes[30] / len(tasks) <= 0.20
    assert [t.task_id for t in tasks] == ids  # the id rebuilds the same task, long or not
    again = [len(task_from_id(t).modules) for t in ids[:50]]
    assert again == [len(t.modules) for t in tasks[:50]]
    # which seeds are long depends on the seed and split only, not on the other knobs
    other = TaskParams(num_modules=12, max_ops=4, long_pct=15, long_modules=40)
    assert [params.modules_of(s, "train") == 30 for s in range(400)] == \
        [other.modules_of(s, "train") == 40 for s in range(400)]
    # without the knob, ids and tasks are what they always were
    assert task_ids(1)[0] == "xlong-v1/train/0/m4.s1-3.c30.t2.h2"
    assert len(task_from_id("xlong-v1/heldout/7/m4.s1-3.c30.t2.h2").modules) == 4
    # a job that turns the tail off keeps its other knobs: long_modules alone means nothing
    assert TaskParams(long_modules=30) == TaskParams()
    assert task_generator({"long_pct": "0", "long_modules": "30"}, 0, 1) == task_generator({}, 0, 1)


@pytest.mark.parametrize("knobs, message", [
    ({"long_pct": "101", "long_modules": "30"}, "long_pct must be a percentage"),
    ({"long_pct": "10", "long_modules": "4"}, "num_modules < long_modules"),
    ({"long_pct": "10"}, "num_modules < long_modules"),
])
def test_bad_long_task_knobs_are_refused(knobs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        task_generator(knobs, 0, 1)
