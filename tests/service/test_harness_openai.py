"""The example external harness (examples/openai_harness.py): the official ``openai`` client against
the gateway's OpenAI-compatible endpoint, a real scheduler and reward service, and its own
ExternalScorer gRPC server that the reward service calls back."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoTokenizer

from services.reward.client import RewardClient
from services.reward.config import RewardConfig
from services.reward.main import build_reward
from services.common.redis_store import connect
from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.openai_http import OpenAIEndpoint
from services.scheduler.jobs import ExecState, Mode, TaskSource
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.sessions import Sessions
from services.task.model import BuiltinModelSpec, ensure_builtin_model
from services.task.tokenizer import Codec
from services.common.roles import AgentRole
from tests.service.scheduler_support import in_process_scheduler, job_spec
from tests.support.rollout_cluster import start_engine, start_gateway

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


class _NoActuator:
    def switch(self, *args: object, **kw: object) -> None:
        raise AssertionError("no switch expected: no cells are registered")


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openai_harness", REPO / "examples" / "openai_harness.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["openai_harness"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("models"),
                                spec=BuiltinModelSpec(demo_tasks=40, snippet_steps=20, sft_steps=20, batch_size=16))


@pytest.fixture
def stack(redis_url: str, tmp_path: Path, model_dir: Path) -> Iterator[dict]:
    rcfg = RewardConfig(redis_url=redis_url, spool_dir=str(tmp_path / "spool"), port=0, scorer_workers=1,
                        scorer_allowlist=("external:127.0.0.1:*",),  # the harness's own scorer, any port
                        log_json=False)
    reward, reward_shutdown = build_reward(rcfg)
    reward.start()
    reward.set_serving(True)
    engine = start_engine("cell-o", checkpoint=model_dir)
    gw = start_gateway()
    gw.client().register_engine(engine.cell_id, engine.address)
    sessions = Sessions(connect(redis_url))
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=AutoTokenizer.from_pretrained(str(model_dir)), model_name="gyre",
                              sessions=sessions)
    http = AsyncOpenAIServer(endpoint).start()
    sessions.publish_http_url(http.base_url)  # what the gateway process does at start
    with in_process_scheduler(redis_url) as sched:
        yield {"scheduler": sched, "gateway": gw, "http": http, "reward": reward.address}
    http.stop()
    gw.stop()
    engine.stop()
    reward_shutdown()
    reward.stop(0)


def test_openai_harness_runs_executions_and_grades_them_itself(stack: dict, model_dir: Path) -> None:
    example = _example()
    sched, gw, http = stack["scheduler"], stack["gateway"], stack["http"]
    sched.client.submit_job(job_spec("oj", model=str(model_dir), num_steps=1, groups_per_step=1, group_size=2,
                                     mode=Mode.COLOCATE, tasks=TaskSource(generator="xlong-v1",
                                                                          params=(("num_modules", "2"),))))
    assert Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600).tick()
    scorer = example.serve_scorer(0)
    try:
        ran = example.run(base_url=http.base_url, scheduler=sched.server.address, reward=stack["reward"],
                          job_id="oj", max_executions=2, idle_exit_s=20.0, scorer_address=scorer.address)
    finally:
        scorer.stop(0)
    assert ran == 2
    eids = {r.execution_id for r in gw.records}
    assert len(eids) == 2
    codec = Codec.from_dir(model_dir)
    reward = RewardClient(stack["reward"])
    for eid in eids:
        recs = [r for r in gw.records if r.execution_id == eid]
        assert all(r.role == AgentRole.MAIN and r.agent_id == "main" for r in recs)
        # The chat template reproduces the built-in prompt format token for token.
        first = codec.tok.decode(recs[0].prompt_ids.tolist(), skip_special_tokens=False)
        assert first.startswith("<|system|> task modules m1 m2 <|user|> module m1 tests")
        assert first.rstrip().endswith("<|user|> step x <|assistant|>")
        # Later turns extend earlier ones exactly (the endpoint reuses the earlier turns' ids).
        assert recs[1].prompt_ids[: len(recs[0].prompt_ids)].tolist() == recs[0].prompt_ids.tolist()
        score = reward.get_score(eid)
        assert score.scorer.startswith("external:") and score.state == "ok" and score.tests_total == 8
        assert sched.client.get_execution(eid).state is ExecState.FINISHED


def test_an_unmodified_client_with_only_a_session_base_url_is_recorded_under_its_execution(stack: dict) -> None:
    import openai

    from services.common.errors import FailedPrecondition, InvalidArgument

    sched, gw = stack["scheduler"], stack["gateway"]
    sched.client.submit_job(job_spec("sj", num_steps=1, groups_per_step=1, group_size=1, mode=Mode.COLOCATE))
    assert Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600).tick()
    lease = sched.client.lease("session-harness", job_id="sj")
    assert lease is not None and lease.session_base_url.startswith(stack["http"].base_url.removesuffix("/v1") + "/s/")
    chat = [{"role": "user", "content": "step add 1"}]

    def ask(base_url: str) -> None:  # an OpenAI client that knows nothing but a base URL
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["gyre"]
        client.chat.completions.create(model="gyre", messages=chat, max_tokens=3)  # type: ignore[arg-type]

    ask(lease.session_base_url)
    _, sub_url = sched.client.mint_session(lease.execution_id, lease.lease_token, agent_id="sub-1", role="subagent")
    ask(sub_url)
    recs = [r for r in gw.records if r.execution_id == lease.execution_id]
    assert [(r.job_id, r.agent_id, r.role, r.attempt) for r in recs] == [("sj", "main", AgentRole.MAIN, 1),
                                                                        ("sj", "sub-1", AgentRole.SUBAGENT, 1)]
    with pytest.raises(openai.NotFoundError, match="unknown or expired session"):
        ask(stack["http"].base_url.removesuffix("/v1") + "/s/not-a-session/v1")
    with pytest.raises(FailedPrecondition, match="not leased with this lease token"):
        sched.client.mint_session(lease.execution_id, "forged", agent_id="sub-2", role="subagent")
    with pytest.raises(InvalidArgument, match="role"):
        sched.client.mint_session(lease.execution_id, lease.lease_token, agent_id="sub-2", role="boss")
    # its harness restarts: the lease is given up and the execution leased again (attempt 2, new sessions)
    assert sched.client.release_harness("session-harness") == [lease.execution_id]
    Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600).tick()
    with pytest.raises(openai.APIStatusError, match="runs again under a new session") as stale:
        ask(lease.session_base_url)
    assert stale.value.status_code == 410
    again = sched.client.lease("session-harness", job_id="sj")
    assert again is not None and again.attempt == 2 and again.session_base_url != lease.session_base_url
    ask(again.session_base_url)
    sched.client.complete(again.execution_id, again.lease_token, ExecState.FINISHED)
    with pytest.raises(openai.APIStatusError, match="execution is finished") as ended:
        ask(again.session_base_url)
    assert ended.value.status_code == 410
    recs = [r for r in gw.records if r.execution_id == lease.execution_id]
    assert [(r.agent_id, r.attempt) for r in recs] == [("main", 1), ("sub-1", 1), ("main", 2)]  # none after the end


def test_a_session_samples_at_its_execution_s_temperature_when_the_call_sends_none(stack: dict) -> None:
    """A CLI such as Claude Code sends no temperature: through a session URL its calls sample at the
    execution's (the job's algorithm.temperature; 0 for a greedy evaluation), not the endpoint's 1;
    the reply says what it sampled at."""
    import dataclasses

    import openai

    from services.scheduler.jobs import Algorithm, JobSpec, lease_temperature

    sched = stack["scheduler"]
    spec = job_spec("tj", num_steps=1, groups_per_step=1, group_size=1, mode=Mode.COLOCATE,
                    algorithm=Algorithm(temperature=0.7))
    sched.client.submit_job(spec)
    assert Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600).tick()
    lease = sched.client.lease("temperature-harness", job_id="tj")
    assert lease is not None
    token = lease.session_base_url.split("/s/", 1)[1].removesuffix("/v1")
    assert Sessions(sched.state.r, sched.state.keys.namespace).resolve(token).temperature == 0.7  # type: ignore[union-attr]
    client = openai.OpenAI(base_url=lease.session_base_url, api_key="unused", max_retries=0)
    chat = [{"role": "user", "content": "step add 1"}]
    sent_none = client.chat.completions.create(model="gyre", messages=chat, max_tokens=3)  # type: ignore[arg-type]
    assert sent_none.model_extra["gyre"]["temperature"] == 0.7  # type: ignore[index]
    sent = client.chat.completions.create(model="gyre", messages=chat, max_tokens=3, temperature=0.2)  # type: ignore[arg-type]
    assert sent.model_extra["gyre"]["temperature"] == 0.2  # type: ignore[index]  # what the call sends wins
    # without a session (a plain route), a call that sends none samples at 1, as before
    plain = openai.OpenAI(base_url=stack["http"].base_url, api_key="unused", max_retries=0)
    assert plain.chat.completions.create(model="gyre", messages=chat, max_tokens=3).model_extra[  # type: ignore[arg-type]
        "gyre"]["temperature"] == 1.0  # type: ignore[index]
    sched.client.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)
    # evaluations are greedy whatever the job's temperature (unless the job turns that off)
    hot: JobSpec = dataclasses.replace(spec, algorithm=Algorithm(temperature=0.7))
    assert lease_temperature(True, hot) == 0.0 and lease_temperature(False, hot) == 0.7
    assert lease_temperature(True, dataclasses.replace(hot, evaluation=dataclasses.replace(
        hot.evaluation, greedy=False))) == 0.7
