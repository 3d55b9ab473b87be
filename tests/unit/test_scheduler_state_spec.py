"""Pure logic behind the scheduler's stored state: job spec validation and JSON, task sources,
proto <-> domain conversions and the execution-id format."""

from __future__ import annotations

import json

import pytest

from services.scheduler.convert import job_from_proto, job_to_proto, spec_from_proto, spec_to_proto
from services.scheduler.jobs import Algorithm, Evaluation, JobSpec, JobState, JobStatus, Mode, TaskSource, TimeoutPolicy
from services.scheduler.state import execution_id, job_of_execution
from services.scheduler.tasks import register_task_generator, resolve_generator, step_payloads


def spec(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(job_id="j", model="m", tasks=TaskSource(payloads=(b"a", b"b", b"c")),
                                   num_steps=3, groups_per_step=2, group_size=4, mode=Mode.ASYNC, staleness_bound=2,
                                   async_rollout_cells=3, timeout_policy=TimeoutPolicy.EXCLUDE,
                                   algorithm=Algorithm(learning_rate=3e-4, kl_coef=0.01, tis_cap=2.0),
                                   evaluation=Evaluation(tasks=8, every=2, greedy=False), scorer="builtin:xlong-v1",
                                   harness="external", seed=7, cell_ids=("c1", "c2"), execution_kv_tokens=4096,
                                   rollout_batches=True, shards=2)
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def test_spec_json_and_proto_round_trip() -> None:
    s = spec()
    assert JobSpec.from_json(s.to_json()) == s
    assert spec_from_proto(spec_to_proto(s), "unused") == s
    g = spec(tasks=TaskSource(generator="numbered"), mode=Mode.ELASTIC, async_rollout_cells=None,
             consolidate_threshold=0.75, min_rollout_cells=0, execution_kv_tokens=None)
    assert spec_from_proto(spec_to_proto(g), "unused") == g
    status = JobStatus(spec=s, state=JobState.RUNNING, created_s=1.5, updated_s=2.5, current_step=1,
                       weight_version=1, enqueued_steps=3, training_step=-1, done_in_step=5, groups_done_in_step=1,
                       queued=10, running=3, totals={"finished": 9, "timeout": 1, "failed": 0, "requeued": 2},
                       message="ok")
    assert job_from_proto(job_to_proto(status)) == status


@pytest.mark.parametrize("kw,needle", [
    (dict(job_id="has space"), "job_id"),
    (dict(job_id="x" * 65), "job_id"),
    (dict(model=""), "model"),
    (dict(num_steps=0), "num_steps"),
    (dict(group_size=0), "group_size"),
    (dict(groups_per_step=1000, group_size=101), "exceeds"),
    (dict(mode=Mode.COLOCATE), "colocate"),
    (dict(staleness_bound=17), "staleness_bound"),
    (dict(execution_timeout_s=0.0), "execution_timeout_s"),
    (dict(max_attempts=0), "max_attempts"),
    (dict(cell_ids=("a", "a")), "more than once"),
    (dict(cell_ids=("a:b",)), "cell id"),
    (dict(async_rollout_cells=None), "async_rollout_cells"),
    (dict(mode=Mode.ELASTIC, consolidate_threshold=0.0), "consolidate_threshold"),
    (dict(shards=0), "shards is 0; expected 1..64 trainer ranks"),
    (dict(shards=65), "shards is 65"),
    (dict(algorithm=Algorithm(kl_coef=0.1, kl_reference="initial")), "a sharded trainer"),
])
def test_invalid_specs_say_which_field(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        spec(**kw)


def test_a_task_source_has_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        TaskSource()
    with pytest.raises(ValueError, match="exactly one of"):
        TaskSource(payloads=(b"x",), generator="numbered")
    with pytest.raises(ValueError, match="at most"):
        TaskSource(payloads=(b"x" * 70_000,))


def test_payloads_cycle_over_groups_and_steps() -> None:
    s = spec()
    assert step_payloads(s, 0) == [b"a", b"b"]
    assert step_payloads(s, 1) == [b"c", b"a"]


def test_generators_are_deterministic_and_pluggable() -> None:
    s = spec(tasks=TaskSource(generator="numbered"))
    assert [json.loads(p) for p in step_payloads(s, 2)] == [{"step": 2, "group": 0, "index": 4},
                                                           {"step": 2, "group": 1, "index": 5}]
    register_task_generator("const", lambda params, step, groups: [params["v"].encode()] * groups)
    c = spec(tasks=TaskSource(generator="const", params=(("v", "hi"),)))
    assert step_payloads(c, 0) == [b"hi", b"hi"]
    assert resolve_generator("services.task.families.numbered:generate") is resolve_generator("numbered")
    with pytest.raises(ValueError, match="unknown task generator"):
        resolve_generator("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_generator("no.such.module:fn")


def test_builtin_task_family_generator() -> None:
    from services.task.spec import task_from_id

    s = spec(tasks=TaskSource(generator="xlong-v1", params=(("num_modules", "3"), ("start_seed", "10"))))
    first, second = (json.loads(p)["task_id"] for p in step_payloads(s, 1))
    assert first != second
    task = task_from_id(first)
    assert task.seed == 12 and len(task.modules) == 3  # start_seed + step * groups + group
    assert step_payloads(s, 1) == step_payloads(s, 1)
    with pytest.raises(ValueError, match="unknown params"):
        step_payloads(spec(tasks=TaskSource(generator="xlong-v1", params=(("bogus", "1"),))), 0)


def test_execution_ids_name_their_job() -> None:
    eid = execution_id("job-7_a", 12, 3, 0)
    assert eid == "job-7_a.s12.g3.e0" and job_of_execution(eid) == "job-7_a"
    assert job_of_execution("not-an-execution") is None and job_of_execution("a.b.c.d") is None
