"""Real coding CLIs, unmodified, from their registries (pinned), against the live stack.

Each CLI runs in its own network namespace whose only reachable address is the test's gateway
(``tests/support/netns.py``), configured with nothing but a lease's session base URL, a dummy key
and the served model's name; its telemetry, error reporting and update checks are off (and could
reach nothing anyway). The engine serves the built-in model (65,536 positions: a coding CLI's
system prompt and tool definitions are 10-20K tokens). The checks are on the records: every call
the CLI made is a TITO record under the lease's execution, and the trajectory paths they form.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.tito import TitoForwarder
from services.trajectory.client import TrajectoryClient
from tests.support import clis, netns
from tests.support.http_stack import http_stack

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
SERVED = "gyre"


@dataclass
class Stack:
    http: AsyncOpenAIServer
    forwarder: TitoForwarder
    trajectory: TrajectoryClient
    redis_url: str
    bridge: netns.UnixToTcp


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    why = netns.netns_available()
    if why:
        pytest.skip(why)
    with http_stack(tmp_path_factory, model="builtin-tiny", served=SERVED, job_id="job-cli",
                    max_body_bytes=16 << 20, max_batch_size=8) as s:
        host, port = s.http.base_url.split("//")[1].split("/")[0].split(":")
        bridge = netns.UnixToTcp(tmp_path_factory.mktemp("bridge") / "gateway.sock", host, int(port))
        try:
            yield Stack(s.http, s.forwarder, s.trajectory, s.redis_url, bridge)
        finally:
            bridge.close()


def _cli(install: Any, which: tuple[str, str, str]) -> Path:
    """The installed CLI; the test is skipped (saying why) where npm is missing or the registry
    cannot be reached from this host, and fails on any other install error."""
    try:
        return Path(install(*which))
    except clis.CliUnavailable as exc:
        pytest.skip(str(exc))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(stack: Stack, argv: Any, env: dict[str, str], cwd: Path,
         accept: Any = None) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI command ``argv(port)`` in a fresh network namespace where the gateway alone is
    reachable, as ``127.0.0.1:port``; returns the finished process and the connections it made.
    It must exit 0, or be one ``accept(proc)`` takes."""
    port = _free_port()
    before = stack.bridge.connections
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd / "home"), "PYTHONPATH": str(clis.REPO), **env}
    (cwd / "home").mkdir(exist_ok=True)
    proc = subprocess.run(netns.command(port, stack.bridge.path, argv(port)), env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 or (accept is not None and accept(proc)), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, stack.bridge.connections - before


def _check_records(stack: Stack, lease: Any, job_id: str, *, one_path: bool = True) -> None:
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats(lease.execution_id, job_id=job_id)
    assert stats.num_calls >= 1 and 1 <= stats.paths <= (1 if one_path else stats.num_calls), stats
    assert stats.trainable_tokens > 0, stats
    assert stats.unique_tokens > 5_000, stats  # its system prompt and tool definitions reached the model


def _wrote_nothing(stack: Stack, lease: Any, job_id: str) -> bool:
    """Whether every call of the execution generated a single token (its end of turn, or a blank):
    a warm start may answer a CLI's prompt, which it never saw, that way (how often depends on the
    CPU that built it), and the CLI then prints an empty reply. The endpoint still served each call,
    and the CLI took its answer."""
    assert stack.forwarder.flush(timeout_s=60)
    stats = stack.trajectory.execution_stats(lease.execution_id, job_id=job_id)
    return stats.num_calls >= 1 and stats.trainable_tokens <= stats.num_calls


@contextmanager
def _session(stack: Stack, job_id: str) -> Iterator[tuple[Any, str]]:
    """A leased execution of a one-execution job and its session token, held while the CLI runs."""
    from tests.e2e.test_smollm2_openai import _leased_session
    from tests.service.scheduler_support import in_process_scheduler

    with in_process_scheduler(stack.redis_url) as sched:
        lease = _leased_session(sched, job_id, f"{job_id}-harness")
        try:
            yield lease, lease.session_base_url.split("/s/", 1)[1].removesuffix("/v1")
        finally:
            sched.client.cancel_job(job_id, "test over")


def test_claude_code_unmodified_through_a_session_url(stack: Stack, tmp_path: Path) -> None:
    """Claude Code (npm, ``claude -p``) with ``ANTHROPIC_BASE_URL`` = a session URL: its Messages
    requests (mid-conversation system messages, thinking/context-management/effort fields, ~20 tools,
    streaming) are served, its reply printed (empty when the model wrote nothing), and its calls
    recorded under the lease's execution."""
    exe = _cli(clis.npm_cli, clis.CLAUDE_CODE)
    env = {"ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": SERVED, "ANTHROPIC_SMALL_FAST_MODEL": SERVED,
           "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    with _session(stack, "claude-job") as (lease, token):
        proc, connections = _run(stack, lambda port: ["env", f"ANTHROPIC_BASE_URL=http://127.0.0.1:{port}/s/{token}",
                                                      str(exe), "-p", "List the files here.", "--max-turns", "1"],
                                 env, tmp_path)
        printed = proc.stdout.strip() or _wrote_nothing(stack, lease, "claude-job")
        assert printed and "API Error" not in proc.stdout and connections >= 1, (
            connections, proc.stdout[-2000:], proc.stderr[-2000:])
        # one call, one path; when the model's reply is empty Claude Code asks again, a sibling of the
        # first call under their shared system prompt and tools (two paths)
        _check_records(stack, lease, "claude-job", one_path=False)


def test_codex_unmodified_through_a_session_url(stack: Stack, tmp_path: Path) -> None:
    """Codex (npm, ``codex exec``) with a model provider whose base URL is a session URL and
    ``wire_api = "responses"``: its Responses requests (developer messages, function tools, a
    namespace of tools, the hosted web_search tool, reasoning/include/client_metadata fields,
    streaming) are served, its reply printed (empty when the model wrote nothing), and its call
    recorded under the lease's execution."""
    exe = _cli(clis.npm_cli, clis.CODEX)
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    env = {"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "unused"}

    def argv(port: int, token: str) -> list[str]:
        provider = (f'model_providers.gyre={{name="gyre", base_url="http://127.0.0.1:{port}/s/{token}/v1", '
                    'wire_api="responses", env_key="OPENAI_API_KEY"}')
        return [str(exe), "exec", "--skip-git-repo-check", "-m", SERVED, "-c", "model_provider=gyre", "-c", provider,
                "-c", "check_for_update_on_startup=false", "List the files here."]

    def out_of_tokens(proc: subprocess.CompletedProcess) -> bool:
        # The built-in model, sampled on a prompt it never saw, may write past the gateway's
        # default_max_tokens without an end of turn: the endpoint answers that Response as
        # "incomplete" (reason max_output_tokens), as OpenAI's does, and `codex exec` then retries
        # and exits 1. That is the model's luck, not a failure of the endpoint: accepted when it is
        # the only error Codex reports (each retry is then a sibling path of the same prompt).
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("ERROR")]
        return proc.returncode == 1 and bool(errors) and all("reason: max_output_tokens" in ln for ln in errors)

    with _session(stack, "codex-job") as (lease, token):
        proc, connections = _run(stack, lambda port: argv(port, token), env, tmp_path, accept=out_of_tokens)
        # the reply: on stdout, or (incomplete) in the transcript on stderr after Codex's "codex" line
        transcript = proc.stderr.split("\ncodex\n", 1)
        printed = proc.stdout.strip() if proc.returncode == 0 else (len(transcript) == 2 and transcript[1].strip())
        # or nothing, exit 0: the Response held an empty message (the model ended its turn at once)
        printed = printed or (proc.returncode == 0 and _wrote_nothing(stack, lease, "codex-job"))
        assert printed and connections >= 1, (connections, proc.stdout[-2000:], proc.stderr[-2000:])
        _check_records(stack, lease, "codex-job", one_path=proc.returncode == 0)


def test_mini_swe_agent_unmodified_through_a_session_url(stack: Stack, tmp_path: Path) -> None:
    """mini-swe-agent (PyPI, ``mini``, its litellm model and default config) with the session URL
    as its model's ``api_base``: two steps. The built-in model writes no bash tool call, and
    mini-swe-agent then sends its format-error message *without* the reply it rejected, so the
    second call is a sibling of the first under their shared prompt: two paths, the prefix once."""
    exe = _cli(clis.pip_cli, clis.MINI_SWE_AGENT)
    env = {"OPENAI_API_KEY": "unused", "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    trajectory = tmp_path / "trajectory.json"
    with _session(stack, "mini-job") as (lease, token):
        proc, connections = _run(stack, lambda port: [
            str(exe), "-m", f"openai/{SERVED}", "-t", "List the files here.", "-y", "--exit-immediately",
            "-o", str(trajectory), "-c", "mini.yaml", "-c", "agent.step_limit=2", "-c", "agent.mode=yolo",
            "-c", f"model.model_kwargs.api_base=http://127.0.0.1:{port}/s/{token}/v1"], env, tmp_path)
        sent = json.loads(trajectory.read_text())
        assert connections >= 1 and sent["info"]["exit_status"] == "LimitsExceeded"
        assert [m["role"] for m in sent["messages"][:3]] == ["system", "user", "user"]  # no assistant turn kept
        assert stack.forwarder.flush(timeout_s=60)
        stats = stack.trajectory.execution_stats(lease.execution_id, job_id="mini-job")
        assert stats.num_calls == 2 and stats.paths == 2 and stats.trainable_tokens > 0
        assert stats.tree_tokens < stats.naive_tokens  # the shared system prompt and task are stored once
