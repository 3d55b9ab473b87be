"""Hosts apart: the stack across three network namespaces, each process run as its systemd unit runs it.

The test builds its own network: a bridge in the root namespace (the "client" host, where `gyre`
runs) and three namespaces on it, each with its own address on a veth pair:

    A  10.x.y.1   redis-server (AOF), trajectory, reward, scheduler, trainer core + core cell daemon
    B  10.x.y.2   engine cell-1 + its cell daemon, the built-in harness worker
    C  10.x.y.3   gateway, engine cell-2 + its cell daemon

Every Gyre process is started with the ExecStart line of its unit in deploy/systemd (variables
from a gyre.env and per-cell engine env files as in the examples, ``%i`` the cell), under
``ip netns exec``; the config is deploy/config/systemd.toml with its directories moved under the
test's tmp dir. Each namespace has its own spool directory. The rollout cells' daemons have a
``train_command``, so a cell that switches to TRAIN runs its trainer replica on its own "host"
and that replica joins the core in namespace A over gloo; drains migrate in-flight requests (with
their KV cache, over UCX) between the engines in B and C. An operator cordons a busy rollout cell
mid-job (`gyre cordon`), so that a drain that migrates and a replica on a rollout host happen
whatever the policy decides.

Credentials and TLS are on, as deployed: `gyre credentials --host` for the three addresses, and
every credentials line of gyre.env.example; every gRPC port refuses plaintext, the gateway's HTTP
endpoint is https with the harness token, and `gyre` runs with the operator's token and the CA.

Checked: the elastic job submitted with `gyre submit --scheduler` completes with final weight
version = steps and every execution ended once; at least one migration went from one namespace's
engine to the other's; at least one replica on a rollout cell (B or C) took part in a step's
all-reduce with the core (world >= 2); no address any process advertised is a loopback one.
Skips (with the reason) where network namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobs import SMALL_TASKS
from tests.support.longcalls import LongCalls
from tests.support.systemd import parse_unit
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
PY = sys.executable
STEPS = 3
# set by services/__init__.py and services/common/logging.py in whatever imports them (this test too)
SET_IN_PROCESS = ("GRPC_VERBOSITY", "TORCH_CPP_LOG_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS")
REDIS_PASSWORD = os.urandom(12).hex()  # Redis on a non-loopback address: with a password, as deployed


def _ip(*args: str, ns: str = "") -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def _free_subnet() -> str:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for _ in range(100):
        net = f"10.{random.randint(100, 250)}.{random.randint(1, 250)}"
        if f" {net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


@dataclass
class Net:
    tag: str
    subnet: str
    namespaces: dict[str, str] = field(default_factory=dict)  # "a" -> netns name

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{'abc'.index(host) + 1}"

    @property
    def bridge(self) -> str:
        return f"gyb{self.tag}"


def _build_net() -> Net:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (`ip`)")
    net = Net(tag=f"{os.getpid() % 10000:04d}", subnet=_free_subnet())
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
    except RuntimeError as exc:
        pytest.skip(f"cannot create a bridge for the test's hosts: {exc}")
    try:
        _ip("link", "set", net.bridge, "up")
        _ip("addr", "add", f"{net.subnet}.254/24", "dev", net.bridge)  # the client host (this process)
        for host in "abc":
            ns = f"gy{net.tag}{host}"
            _ip("netns", "add", ns)
            net.namespaces[host] = ns
            outer, inner = f"gy{net.tag}{host}h", f"gy{net.tag}{host}n"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", net.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("addr", "add", f"{net.addr(host)}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
    except RuntimeError as exc:
        _teardown_net(net)
        pytest.skip(f"cannot create network namespaces here: {exc}")
    return net


def _teardown_net(net: Net) -> None:
    for ns in net.namespaces.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", net.bridge], capture_output=True)


def unit_argv(unit: str, env: dict[str, str], instance: str = "") -> list[str]:
    """The ExecStart of ``deploy/systemd/<unit>``: ${VAR} from ``env``, %i = ``instance``, the
    install's python (/opt/gyre/.venv/bin/python) = this interpreter, and its /etc/gyre/gyre.toml =
    ``env["GYRE_TEST_CONFIG"]`` (the test's copy of deploy/config/systemd.toml)."""
    line = parse_unit(UNITS / unit)["Service"]["ExecStart"][0].replace("%i", instance)

    def var(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            raise AssertionError(f"{unit} uses ${{{m.group(1)}}}, which the test's gyre.env does not set")
        return env[m.group(1)]

    argv = shlex.split(re.sub(r"\$\{([A-Z0-9_]+)\}", var, line))
    assert argv[0] == "/opt/gyre/.venv/bin/python", argv
    return [PY, *(env["GYRE_TEST_CONFIG"] if a == "/etc/gyre/gyre.toml" else a for a in argv[1:])]


class Hosts:
    """The processes of the three namespaces; logs under ``logs/<name>.log``."""

    def __init__(self, net: Net, root: Path) -> None:
        self.net = net
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (root / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, host: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.root / "logs" / f"{name}.log", "wb")
        # what a unit gets: not the knobs this test process (or pytest) set for itself
        inherited = {k: v for k, v in os.environ.items() if k not in SET_IN_PROCESS}
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **env}
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", self.net.namespaces[host], *argv], cwd=REPO,
                                            env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def pause(self, name: str) -> None:
        """SIGSTOP ``name``'s process group (``resume`` continues it)."""
        os.killpg(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        if self.procs[name].poll() is None:
            os.killpg(self.procs[name].pid, signal.SIGCONT)

    def log(self, name: str) -> str:
        return (self.root / "logs" / f"{name}.log").read_text(errors="replace")

    def names(self) -> list[str]:
        return list(self.procs)

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, {n: (rc, self.log(n)[-2000:]) for n, rc in dead.items()}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _wait_ready(address: str, hosts: Hosts, timeout_s: float = 240.0) -> None:
    from services.common.server import wait_for_ready

    def serving() -> bool:
        hosts.check_alive()
        try:
            wait_for_ready(address, timeout_s=2.0)
            return True
        except TimeoutError:
            return False

    wait_until(serving, timeout_s, f"{address} to serve", poll_s=0)


def _wait_redis(url: str, hosts: Hosts) -> None:
    import redis

    def answers() -> bool:
        hosts.check_alive()
        try:
            return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
        except redis.exceptions.ConnectionError:
            return False

    wait_until(answers, 30, "redis-server to answer", poll_s=0.1)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hosts, dict[str, str]]]:
    net = _build_net()
    root = tmp_path_factory.mktemp("hosts-apart")
    hosts = Hosts(net, root)
    a, b, c = (net.addr(h) for h in "abc")
    config = root / "gyre.toml"  # deploy/config/systemd.toml, its directories under the tmp dir
    from services.models.source import DEFAULT_CACHE, resolve_model

    config.write_text((REPO / "deploy" / "config" / "systemd.toml").read_text()
                      .replace("/var/lib/gyre/models", str(DEFAULT_CACHE))
                      .replace("/var/log/gyre", str(root / "logs")))
    env = {  # /etc/gyre/gyre.env of every host (deploy/systemd/gyre.env.example)
        "REDIS_URL": f"redis://:{REDIS_PASSWORD}@{a}:6379/0", "GYRE_MODEL_CACHE": str(DEFAULT_CACHE),
        "TRAJECTORY_ADDRESS": f"{a}:50051", "REWARD_ADDRESS": f"{a}:50052", "TRAINER_ADDRESS": f"{a}:50053",
        "GATEWAY_ADDRESS": f"{c}:50060", "SCHEDULER_ADDRESS": f"{a}:50050",
        "ENGINE_ADDRESSES": f"cell-1={b}:50061,cell-2={c}:50061", "GYRE_MODEL": "builtin-tiny",
        "GYRE_TORCH_THREADS": "1", "CORE_CELL_ID": "cell-0",
        # the checkpoints live on the trainer's host (A); the scheduler names the directory
        "GYRE_SCHEDULER_CHECKPOINT_DIR": str(root / "a" / "checkpoints"),
        "GYRE_CELL_DAEMON_HEARTBEAT_INTERVAL_S": "1", "GYRE_TEST_CONFIG": str(config),
    }
    # credentials and TLS as deployed: `gyre credentials` with every host's address in the node
    # certificate, and every credentials line of gyre.env.example (its directory moved here)
    creds = root / "credentials"
    made = subprocess.run([PY, "-m", "services.cli", "credentials", str(creds), *(f"--host={h}" for h in (a, b, c))],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    for line in (UNITS / "gyre.env.example").read_text().splitlines():
        if "=/etc/gyre/credentials/" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value.replace("/etc/gyre/credentials", str(creds))
    assert env.get("GYRE_GATEWAY_TLS_CERT_FILE") and env.get("GYRE_SCHEDULER_AUTH_TOKENS_FILE"), sorted(env)
    per_host = {h: {**env, "GYRE_SPOOL_DIR": str(root / h / "spool")} for h in "abc"}
    for h in "abc":
        (root / h / "spool").mkdir(parents=True)
    engine_env = {  # /etc/gyre/engine-<cell>.env (deploy/systemd/engine-cell.env.example)
        h: {"GYRE_ENGINE_PORT": "50061", "GYRE_ENGINE_METRICS_PORT": "9161", "GYRE_ENGINE_ADVERTISE_HOST": net.addr(h),
            # UCX over its TCP transport, as on a fabric without RDMA: the namespaces share one
            # kernel, so UCX's shared-memory transports would take them for one host (and hang)
            "UCX_TLS": "tcp",
            # the cell's daemon runs the trainer replica on the cell's own host when it trains
            "GYRE_CELL_DAEMON_TRAIN_COMMAND": f"{PY} -m services.trainer.main --replica --core {a}:50053 "
                                             "--cell-id {cell_id} --replica-id {cell_id}-{switch_id} "
                                             "--replica-threads 1"}
        for h in "bc"}
    from services.common import security

    security.configure(security.Security(tls_ca_file=str(creds / "ca.pem"),
                                         auth_token=(creds / "internal.token").read_text().strip()))
    try:
        redis_dir = root / "a" / "redis"
        redis_dir.mkdir(parents=True)
        conf = redis_dir / "redis.conf"  # the password in a file (mode 0600), not on argv
        conf.write_text(f"requirepass {REDIS_PASSWORD}\n")
        conf.chmod(0o600)
        hosts.start("redis", "a", [shutil.which("redis-server") or "redis-server", str(conf), "--port", "6379",
                                   "--bind", a, "--dir", str(redis_dir), "--appendonly", "yes", "--save", ""], {})
        _wait_redis(env["REDIS_URL"], hosts)
        hosts.start("trajectory", "a", unit_argv("gyre-trajectory.service", per_host["a"]), per_host["a"])
        hosts.start("reward", "a", unit_argv("gyre-reward.service", per_host["a"]), per_host["a"])
        hosts.start("trainer", "a", unit_argv("gyre-trainer.service", per_host["a"]), per_host["a"])
        for addr in (f"{a}:50051", f"{a}:50052", f"{a}:50053"):
            _wait_ready(addr, hosts)
        for h, cell in (("b", "cell-1"), ("c", "cell-2")):
            e = {**per_host[h], **engine_env[h]}
            hosts.start(f"engine-{cell}", h, unit_argv("gyre-engine@.service", e, cell), e)
        for h in "bc":
            _wait_ready(f"{net.addr(h)}:50061", hosts)
        hosts.start("gateway", "c", unit_argv("gyre-gateway.service", per_host["c"]), per_host["c"])
        _wait_ready(f"{c}:50060", hosts)
        hosts.start("scheduler", "a", unit_argv("gyre-scheduler.service", per_host["a"]), per_host["a"])
        _wait_ready(f"{a}:50050", hosts)
        hosts.start("cell-0", "a", unit_argv("gyre-core-daemon.service", per_host["a"]), per_host["a"])
        for h, cell in (("b", "cell-1"), ("c", "cell-2")):
            e = {**per_host[h], **engine_env[h]}
            hosts.start(f"daemon-{cell}", h, unit_argv("gyre-cell-daemon@.service", e, cell), e)
        hosts.start("harness", "b", [PY, "-m", "services.harness", "--config", str(config), "--scheduler",
                                     f"{a}:50050", "--gateway", f"{c}:50060", "--reward", f"{a}:50052",
                                     "--model-dir", str(resolve_model("builtin-tiny")), "--concurrency", "4", "--call-retries", "60"],
                    per_host["b"])
        # the units name the Redis URL's variable (--redis-url env:REDIS_URL): its password is in no
        # process's command line (anyone on a host can read /proc/*/cmdline)
        leaked = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if REDIS_PASSWORD.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    leaked.append(pid)
            except OSError:
                pass
        assert not leaked, leaked
        yield hosts, {"scheduler": f"{a}:50050", "gateway": f"{c}:50060", "trainer": f"{a}:50053",
                      "trajectory": f"{a}:50051", "reward": f"{a}:50052", "http": f"{c}:8000",
                      "credentials": str(creds)}
    finally:
        security.configure(security.Security())
        hosts.stop()
        _teardown_net(net)


def _cells(scheduler: str) -> list:
    from services.scheduler.client import SchedulerClient

    with SchedulerClient(scheduler) as s:
        return [info.cell for info in s.list_cells()]


def _cordon_a_busy_cell(sched: Any, job_id: str, cli: list[str], operator: dict[str, str]) -> str:
    """Once the job's executions run and both rollout cells have requests in flight, the operator
    cordons the busier with `gyre cordon`: its requests migrate to the other host's engine and it
    trains (its replica, on its own host, joins the core) until the job ends, whatever the policy
    would have done. When a cordon's drain found nothing left to migrate, the cell given back may
    stay in TRAIN (the policy needs one rollout cell for this small job): then the one rollout cell
    left is cordoned, and the policy brings the other back to take its requests, which migrate.
    "" while not yet (or while the scheduler does not answer in time: next poll)."""
    from services.common.errors import Unavailable

    try:
        if sched.get_job(job_id).running == 0:
            return ""
        rolling = sorted((i.cell.inflight, i.cell.cell_id) for i in sched.list_cells()
                         if i.cell.role.value == "rollout" and not i.cell.is_core)
    except Unavailable:
        return ""
    if not rolling or rolling[0][0] == 0:  # every rollout cell busy (one, after a drain without migration)
        return ""
    cell = rolling[-1][1]
    done = subprocess.run([*cli, "cordon", "--scheduler", sched.address, cell, "--reason",
                           "e2e: train on a rollout host"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=operator)
    assert done.returncode == 0, done.stdout + done.stderr
    return cell


def _drained_without_migrating(sched: Any, job_id: str, cell: str, since: float) -> bool:
    """Whether ``cell``'s cordon switch to TRAIN (after ``since``) finished without migrating."""
    from services.common.errors import Unavailable

    try:
        events = [e for e in sched.watch(job_id, follow=False) if e.ts_s >= since - 1.0
                  and e.attrs.get("cell_id") == cell]
    except Unavailable:
        return False
    switched = any(e.kind == "switch_finished" and e.attrs.get("to") == "train" for e in events)
    return switched and not any(e.kind == "migration" for e in events)


def _every_port_is_tls_only(addr: dict[str, str], cells: dict) -> None:
    """TLS by default: every gRPC port refuses a plaintext client (health included) and serves one
    that trusts the deployment's CA; the gateway's HTTP endpoint is https and wants the harness token."""
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.security import open_channel

    ports = {*(addr[s] for s in ("scheduler", "gateway", "trainer", "trajectory", "reward")),
             *(c.engine_address for c in cells.values() if c.engine_address)}
    for port in sorted(ports):
        with grpc.insecure_channel(port) as plain:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        with open_channel(port) as secure:
            assert health_pb2_grpc.HealthStub(secure).Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
    creds = Path(addr["credentials"])
    ctx = ssl.create_default_context(cafile=str(creds / "ca.pem"))
    url = f"https://{addr['http']}/v1/models"
    harness = (creds / "harness.token").read_text().strip()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {harness}"}),
                                context=ctx, timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["data"], url
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, context=ctx, timeout=10)
    assert refused.value.code == 401
    with pytest.raises((OSError, http.client.HTTPException)):  # plaintext HTTP to the TLS port: no answer
        urllib.request.urlopen(f"http://{addr['http']}/v1/models", timeout=10)


@pytest.mark.timeout(1200)
def test_elastic_job_across_three_hosts(hosts: tuple[Hosts, dict[str, str]]) -> None:
    procs, addr = hosts
    def registered() -> bool:
        procs.check_alive()
        return len([c for c in _cells(addr["scheduler"]) if c.cell_id in ("cell-0", "cell-1", "cell-2")]) == 3

    wait_until(registered, 120, "the three cells to register", poll_s=0.2)
    cells = {c.cell_id: c for c in _cells(addr["scheduler"])}
    loopback = [(c.cell_id, c.address, c.engine_address) for c in cells.values()
                if c.address.startswith("127.") or c.address.startswith("0.0.0.0")
                or c.engine_address.startswith("127.")]
    assert not loopback, loopback
    assert cells["cell-1"].hosts_replica and cells["cell-2"].hosts_replica and not cells["cell-0"].hosts_replica

    _every_port_is_tls_only(addr, cells)

    cli = [PY, "-m", "services.cli"]
    creds = Path(addr["credentials"])
    # the operator's credential and the deployment's CA, from the environment (never argv)
    operator = {**os.environ, "GYRE_TOKEN_FILE": str(creds / "operator.token"), "GYRE_TLS_CA_FILE": str(creds / "ca.pem")}
    job_file = str(REPO / "deploy" / "config" / "job.toml")
    sub = subprocess.run([*cli, "submit", "--scheduler", addr["scheduler"], job_file, "--mode", "elastic",
                          "--num_steps", str(STEPS), "--groups_per_step", "4", "--group_size", "2",
                          "--evaluation.tasks", "0", *SMALL_TASKS, "--execution_timeout_s", "300"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=operator)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = sub.stdout.strip().splitlines()[-1]
    long_calls = LongCalls()
    long_calls.start(addr["gateway"])
    watch = subprocess.Popen([*cli, "watch", "--scheduler", addr["scheduler"], job_id, "--json"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=operator)
    cordoned, attempts, cordoned_at = "", 0, 0.0
    from services.scheduler.client import SchedulerClient

    # While a cordoned cell's replica starts, the harness worker is stopped (SIGSTOP): the job's
    # executions cannot finish its steps before that replica joined one, however slow the host is to
    # start a trainer process (a wait on a condition; the 45 s cap stays inside the 60 s lease TTL)
    paused: list[Any] = []  # [cell, its daemon log's length at the cordon, monotonic at the pause]
    sched = SchedulerClient(addr["scheduler"])  # one channel (one TLS handshake) for the whole watch
    try:
        deadline = time.monotonic() + 1000
        while watch.poll() is None:  # every process stays up (nothing here restarts one)
            procs.check_alive()
            assert time.monotonic() < deadline, "the job did not end"
            if paused and (paused[0] != cordoned or time.monotonic() - paused[2] > 45
                           or '"replica ready"' in procs.log(f"daemon-{paused[0]}")[paused[1]:]):
                procs.resume("harness")
                paused = []
            if not cordoned and attempts < 6:
                seen = {c: len(procs.log(f"daemon-{c}")) for c in ("cell-1", "cell-2")}
                cordoned = _cordon_a_busy_cell(sched, job_id, cli, operator)
                attempts, cordoned_at = attempts + bool(cordoned), time.time()
                if cordoned and not paused:
                    procs.pause("harness")
                    paused = [cordoned, seen[cordoned], time.monotonic()]
            elif cordoned and attempts < 6 and _drained_without_migrating(sched, job_id, cordoned, cordoned_at):
                # its requests ended before the drain reached them: give it back, cordon again later
                subprocess.run([*cli, "uncordon", "--scheduler", sched.address, cordoned], cwd=REPO,
                               capture_output=True, text=True, timeout=60, env=operator, check=True)
                cordoned = ""
            time.sleep(0.2)
    finally:
        procs.resume("harness")
        sched.close()
        long_calls.stop()
        if watch.poll() is None:
            watch.kill()
    out, err = watch.communicate()
    events = [json.loads(x) for x in out.splitlines() if x.strip()]
    assert watch.returncode == 0, (events[-5:], err[-2000:])
    procs.check_alive()
    last = events[-1]
    assert last["kind"] == "end" and last["state"] == "completed" and last["weight_version"] == STEPS, last
    ended = [e["execution_id"] for e in events if e["kind"] == "execution_completed" and not e.get("evaluation")]
    assert len(ended) == len(set(ended)) == STEPS * 8, sorted(ended)
    assert long_calls.failed == 0

    # a KV migration from one namespace's engine to the other's
    host_of = {"cell-1": "b", "cell-2": "c"}
    migrations = [e for e in events if e["kind"] == "migration"]
    across = [m for m in migrations if any(host_of.get(t) not in (None, host_of.get(m["cell_id"]))
                                           for t in m.get("targets", "").split(","))]
    assert across, migrations or [e for e in events if e["kind"].startswith("switch")]
    assert any("ucx" in json.loads(m.get("transports", "{}")) for m in across), across

    # a replica on a rollout cell's own host (B or C) all-reduced a step with the core (in A)
    joined = []
    for cell in ("cell-1", "cell-2"):
        for line in procs.log(f"daemon-{cell}").splitlines():
            if '"replica step done"' in line:
                rec = json.loads(line)
                if int(rec.get("world", 0)) >= 2:
                    joined.append((cell, rec.get("step"), rec.get("world")))
    replica_lines = [(cell, rec.get("event"), rec.get("step"), rec.get("world"), rec.get("timestamp"))
                     for cell in ("cell-1", "cell-2") for line in procs.log(f"daemon-{cell}").splitlines()
                     if '"services.trainer.replica"' in line for rec in [json.loads(line)]]
    switches = [(e["kind"], e.get("cell_id"), e.get("to"), str(e.get("error", ""))[:200]) for e in events
                if e["kind"].startswith("switch") or e["kind"] == "migration"]
    assert cordoned and any(cell == cordoned for cell, _, _ in joined), (cordoned, attempts, joined, replica_lines,
                                                                          switches)

    # no secret of the deployment (role tokens, KV key, CA and node keys, Redis password) in any log
    creds = Path(addr["credentials"])
    secrets = [REDIS_PASSWORD, (creds / "kv.key").read_text().strip(),
               *(t for _, t in (ln.split() for ln in (creds / "tokens").read_text().splitlines()
                                if ln and not ln.startswith("#"))),
               *((creds / k).read_text().splitlines()[1] for k in ("ca.key", "node.key"))]
    assert len(secrets) == 7 and all(len(x) >= 16 for x in secrets)
    leaked = [name for name in procs.names() if any(x in procs.log(name) for x in secrets)]
    assert not leaked, leaked
    # every line every Gyre process wrote is JSON (no progress bars, no C++ core lines), as deployed
    plain = {name: [ln for ln in procs.log(name).splitlines() if ln.strip() and not ln.startswith("{")][:3]
             for name in procs.names() if name != "redis"}
    assert not any(plain.values()), {k: v for k, v in plain.items() if v}
