"""The task-family registry: one place names families; scheduler and reward resolve through it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from services.reward.scorers import ScoreInput, ScorerSpec, run_local
from services.scheduler.jobs import JobSpec, Mode, TaskSource
from services.scheduler.tasks import TASK_GENERATORS, heldout_payloads, resolve_generator, step_payloads
from services.task import registry

REPO = Path(__file__).resolve().parents[2]


def job(generator: str, params: tuple[tuple[str, str], ...] = ()) -> JobSpec:
    return JobSpec(job_id="j1", model="m", tasks=TaskSource(generator=generator, params=params), num_steps=4,
                   groups_per_step=3, group_size=2, mode=Mode.COLOCATE)


def test_builtin_families_resolve() -> None:
    assert {"xlong-v1", "arith-v1", "numbered"} <= set(registry.families())
    xlong = registry.get_family("xlong-v1")
    assert xlong.default_scorer == "xlong-v1" and set(xlong.scorers) == {"xlong-v1", "xlong-v1-tests"}
    for fam in registry.families().values():
        for path in (fam.generator, fam.heldout, fam.runner, *fam.scorers.values()):
            if path:
                assert callable(registry.load(path))
    assert registry.family_of_task("arith-v1/train/4/n3.v10").name == "arith-v1"
    numbered = registry.get_family("numbered")
    assert not numbered.scorers and not numbered.runner and not numbered.heldout and not numbered.default_scorer
    assert registry.get_family("arith-v1").scorers == {"arith-v1": "services.task.arith:score"}
    assert {"xlong-v1", "xlong-v1-tests", "arith-v1"} <= set(registry.builtin_scorers())


def test_unknown_family_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown task family 'nope'; known: .*arith-v1.*numbered.*xlong-v1"):
        registry.get_family("nope")
    with pytest.raises(ValueError, match="unknown builtin scorer 'nope'; known: .*xlong-v1-tests"):
        ScorerSpec(kind="builtin", target="nope")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.TaskFamily(name="xlong-v1", generator="a.b:c"))
    with pytest.raises(ValueError, match="default_scorer"):
        registry.TaskFamily(name="x", generator="a.b:c", scorer="a.b:d", default_scorer="y")
    with pytest.raises(ValueError, match="package.module:function"):
        registry.TaskFamily(name="x", generator="not a path")


@pytest.mark.parametrize("name, params", [("xlong-v1", {"num_modules": "2", "start_seed": "5"}),
                                          ("arith-v1", {"turns": "2"})])
def test_heldout_payloads_are_deterministic_and_not_train_tasks(name: str, params: dict[str, str]) -> None:
    held = heldout_payloads(name, params, 8)
    assert held == heldout_payloads(name, params, 8) and len(set(held)) == 8
    ids = [json.loads(p)["task_id"] for p in held]
    assert all(t.startswith(f"{name}/heldout/") for t in ids)
    train = {p for step in range(4) for p in step_payloads(job(name, tuple(params.items())), step)}
    assert train and not train & set(held)


def test_heldout_payloads_need_a_family_with_a_heldout_set() -> None:
    with pytest.raises(ValueError, match="'numbered' has no held-out tasks"):
        heldout_payloads("numbered", {}, 2)
    with pytest.raises(ValueError, match="'external' is not a task family"):
        heldout_payloads("external", {}, 2)
    with pytest.raises(ValueError, match="unknown params"):
        heldout_payloads("xlong-v1", {"bogus": "1"}, 2)


def test_external_generator_marks_its_payloads() -> None:
    assert [json.loads(p) for p in step_payloads(job("external"), 1)] == [
        {"step": 1, "group": g, "index": 3 + g, "external": True} for g in range(3)]
    with pytest.raises(ValueError, match="takes no params"):
        step_payloads(job("external", (("a", "1"),)), 0)


def test_generator_table_lists_families_and_own_generators() -> None:
    assert {"external", "numbered", "xlong-v1", "arith-v1"} <= set(TASK_GENERATORS)
    assert "xlong-v1" in TASK_GENERATORS and "nope" not in TASK_GENERATORS
    assert resolve_generator("numbered") is registry.load(registry.get_family("numbered").generator)


def test_scheduler_and_registry_import_no_heavy_code() -> None:
    code = ("import sys, services.scheduler.tasks, services.task.registry as r; r.families(); "
            "assert not {'torch', 'transformers', 'numpy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_a_family_in_one_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "toy_family.py").write_text(textwrap.dedent('''
        import json

        from services.task.registry import TaskFamily


        def generate(params, step, groups):
            return [json.dumps({"task_id": f"toy-v1/train/{step * groups + g}"}).encode() for g in range(groups)]


        def heldout(params, n):
            return [json.dumps({"task_id": f"toy-v1/heldout/{i}"}).encode() for i in range(n)]


        def score(files, task_id, status):
            return {"score": float(files.get("answer") == task_id.rsplit("/", 1)[1].encode())}


        FAMILY = TaskFamily(name="toy-v1", generator="toy_family:generate", heldout="toy_family:heldout",
                            scorer="toy_family:score")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_FAMILIES", registry.families())  # the registration ends with the test
    family = registry.register_module("toy_family")
    assert registry.register(family) is family  # registering the same record again is a no-op

    assert [json.loads(p)["task_id"] for p in step_payloads(job("toy-v1"), 1)] == [
        "toy-v1/train/3", "toy-v1/train/4", "toy-v1/train/5"]
    assert len(heldout_payloads("toy-v1", {}, 2)) == 2
    out = run_local(ScorerSpec(kind="builtin", target="toy-v1"),
                    ScoreInput(job_id="j", execution_id="e", task_id="toy-v1/train/3", status="finished",
                               files={"answer": b"3"}))
    assert out.score == 1.0


class _Scheduler:
    def __init__(self) -> None:
        self.completed: list[tuple[str, str, str]] = []

    def get_job(self, job_id: str) -> Any:
        return SimpleNamespace(spec=SimpleNamespace(timeout_policy="partial"))

    def complete(self, execution_id: str, token: str, state: Any, reason: str) -> None:
        self.completed.append((execution_id, state.value, reason))


class _Reward:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def submit_workspace(self, job_id: str, execution_id: str, files: dict[str, bytes], *, task_id: str) -> None:
        self.files = dict(files)

    def score(self, job_id: str, execution_id: str, status: str, **_: Any) -> None:
        pass


class _Answers:
    """A ModelClient that answers every arith turn right."""

    def __init__(self, tok: Any, task: Any) -> None:
        self.tok, self.answers, self.calls = tok, task.answers, 0

    def generate(self, context: Any, prompt_ids: Any, sampling: Any, *, timeout_s: float) -> Any:
        from services.task.agent import Generation

        ids = self.tok(str(self.answers[self.calls]), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        self.calls += 1
        return Generation(output_ids=np.asarray(ids, np.int32), logprobs=np.zeros(len(ids), np.float32),
                          weight_version=1, finish_reason="stop")

    def forget(self, execution_id: str) -> None:
        pass


def test_the_harness_runs_the_family_the_task_id_names() -> None:
    from transformers import AutoTokenizer

    from services.models.source import SMOLLM2, resolve_model
    from services.task import arith
    from services.harness.harness import Harness, HarnessConfig

    task_id = "arith-v1/train/4/n3.v10"
    tok = AutoTokenizer.from_pretrained(str(resolve_model(SMOLLM2)), local_files_only=True)
    scheduler, reward = _Scheduler(), _Reward()
    harness = Harness(HarnessConfig(), scheduler=scheduler, gateway=None, reward=reward)
    harness.model = _Answers(tok, arith.task_from_id(task_id))  # type: ignore[assignment]
    harness._chat_tokenizer = tok

    def run(payload: dict[str, Any]) -> tuple[str, str]:
        lease = SimpleNamespace(execution_id="e1", job_id="j", lease_token="t", lease_ttl_s=30.0, deadline_s=0.0,
                                group_id="g", step=0, payload=json.dumps(payload).encode())
        harness._run(lease)
        _eid, status, reason = scheduler.completed.pop()
        return status, reason

    assert run({"task_id": task_id}) == ("finished", "")
    assert arith.score(reward.files, task_id, "finished")["score"] == 1.0
    status, reason = run({"task_id": "numbered/0"})
    assert status == "failed" and "'numbered' has no harness runner" in reason
    status, reason = run({"task_id": "nope-v1/train/0"})
    assert status == "failed" and "unknown task family 'nope-v1'" in reason
