"""Per-role credentials on a real scheduler process (its tokens file from the environment, as a
deployment passes secrets): an operator submits and cancels jobs and cordons cells, a harness
leases executions, only internal services register cells; a credential calling outside its role
is PERMISSION_DENIED before anything is written, an unknown one UNAUTHENTICATED. The `gyre`
command takes the operator's credential from GYRE_TOKEN_FILE."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import errors, security
from services.common.security import Security
from services.scheduler.client import SchedulerClient
from services.scheduler.jobfile import load_job
from services.common.roles import CellRole
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, stop_all

REPO = Path(__file__).resolve().parents[2]
TOKENS = {"internal": "internal-token-0123456789", "harness": "harness-token-0123456789",
          "operator": "operator-token-0123456789"}
JOB = REPO / "deploy" / "config" / "job.toml"


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory, _session_redis: RedisServer) -> Iterator[ServiceProcess]:
    work = tmp_path_factory.mktemp("roles")
    tokens = work / "tokens"
    tokens.write_text("# role token\n" + "".join(f"{r} {t}\n" for r, t in TOKENS.items()))
    tokens.chmod(0o600)
    proc = ServiceProcess.start("scheduler", "services.scheduler.main", work,
                                ["--redis-url", _session_redis.url.removesuffix("/0") + "/5", "--tick-interval-s", "0.2",
                                 "--actuator", "daemon"],
                                env={"GYRE_SCHEDULER_AUTH_TOKENS_FILE": str(tokens)})
    try:
        yield proc.wait_ready(timeout_s=60)
    finally:
        stop_all([proc])


def _as(role: str | None) -> Iterator[None]:
    security.configure(Security(auth_token=TOKENS[role] if role else ""))
    try:
        yield
    finally:
        security.configure(Security())


def _client(address: str) -> SchedulerClient:
    return SchedulerClient(address, timeout_s=10)


def test_each_role_calls_only_its_rpcs_and_refused_calls_write_nothing(scheduler: ServiceProcess) -> None:
    spec = load_job(JOB, ["--num_steps", "1"])
    for _ in _as("operator"):
        with _client(scheduler.address) as c:
            job = c.submit_job(spec)
            jobs_before = len(c.list_jobs()[0])
            with pytest.raises(errors.PermissionDenied, match="operator credential may not call"):
                c.lease("w-op")  # an operator is not a harness
    for _ in _as("harness"):
        with _client(scheduler.address) as c:
            for call in (lambda: c.submit_job(spec), lambda: c.cancel_job(job.job_id),
                         lambda: c.cordon_cell("cell-x"), lambda: c.list_jobs()):
                with pytest.raises(errors.PermissionDenied, match="harness credential"):
                    call()
            with pytest.raises(errors.PermissionDenied, match="internal"):
                c.register_cell(cell_id="cell-evil", address="127.0.0.1:9", role=CellRole.ROLLOUT)
            c.lease("w-harness")  # its own RPCs pass (nothing may be leasable yet: no engines)
            assert c.get_job(job.job_id).job_id == job.job_id
    for _ in _as(None):
        with _client(scheduler.address) as c, pytest.raises(errors.GyreError, match="UNAUTHENTICATED|bearer"):
            c.get_job(job.job_id)
    for _ in _as("internal"):
        with _client(scheduler.address) as c:
            assert len(c.list_jobs()[0]) == jobs_before  # the refused submits wrote nothing
            assert "cell-evil" not in {i.cell.cell_id for i in c.list_cells()}
            assert c.get_job(job.job_id).state.value != "cancelled"


def test_the_gyre_command_takes_the_operator_credential_from_the_environment(scheduler: ServiceProcess,
                                                                              tmp_path: Path) -> None:
    def gyre(role: str) -> subprocess.CompletedProcess[str]:
        token = tmp_path / f"{role}.token"
        token.write_text(TOKENS[role] + "\n")
        return subprocess.run([sys.executable, "-m", "services.cli", "jobs", "--scheduler", scheduler.address],
                              cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "GYRE_TOKEN_FILE": str(token)})

    ok = gyre("operator")
    assert ok.returncode == 0, ok.stderr
    refused = gyre("harness")
    assert refused.returncode != 0 and "harness credential may not call" in refused.stderr
    assert TOKENS["harness"] not in refused.stdout + refused.stderr  # the secret is not echoed
