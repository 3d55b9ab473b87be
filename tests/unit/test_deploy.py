"""deploy/ stays in step with the launcher: the systemd units and the compose services run the same
modules with the same flags as ``services.launcher.service_command``, and every shipped config
file parses into its services' config classes."""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import ServerConfig, load_config
from services.launcher import ServiceSpec, default_specs, service_command
from tests.support.systemd import parse_unit

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
# service configs; job files (job*.toml: a [job] JobSpec) are parsed in tests/unit/test_run_config.py
CONFIGS = sorted(p for p in (DEPLOY / "config").glob("*.toml") if not p.name.startswith("job"))
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
SECTIONS = tuple(dict.fromkeys(s.section for s in default_specs(num_engines=1) if s.serves))
# shared fields; `gyre run`'s stack (services/run.py); the built-in harness workers (services/harness)
OTHER_SECTIONS = {"common", "run", "harness"}
DEPLOYMENTS = ("compose.toml", "systemd.toml")


# -- helpers ------------------------------------------------------------------------------------
def launcher_argv(spec: ServiceSpec) -> list[str]:
    addresses = {s.name: "127.0.0.1:1" for s in default_specs(num_engines=2)}
    return service_command(spec, config=Path("cfg.toml"), redis_url="redis://r:6379/0", spool_dir=Path("spool"),
                           addresses=addresses)


def variants() -> dict[tuple[str, tuple[str, ...]], ServiceSpec]:
    """Each distinct (module, flag names) the launcher runs -> one spec that runs it (engine cells
    share one variant; the core cell daemon and the rollout cell daemons are two)."""
    out: dict[tuple[str, tuple[str, ...]], ServiceSpec] = {}
    for spec in default_specs(num_engines=2):
        if spec.serves:
            module, flags = module_and_flags(launcher_argv(spec))
            out.setdefault((module, tuple(flags)), spec)
    return out


def spec_for(argv: list[str], where: str) -> ServiceSpec:
    """The launcher spec whose module and flag names ``argv`` runs (fails naming the difference)."""
    module, flags = module_and_flags(argv)
    known = variants()
    if (module, tuple(flags)) not in known:
        same_module = [list(f) for m, f in known if m == module]
        raise AssertionError(f"{where} runs {module} with flags {flags}; the launcher runs it with "
                             f"{same_module or 'no such module'}")
    return known[module, tuple(flags)]


def module_and_flags(argv: list[str]) -> tuple[str, list[str]]:
    """(module after ``-m``, the flag names in order) of a ``python -m module --flag value ...`` line."""
    assert Path(argv[0]).name.startswith("python"), f"not a python command: {argv}"
    assert argv[1] == "-m", f"not run as a module: {argv}"
    return argv[2], [a for a in argv[3:] if a.startswith("--")]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def env_file_vars(path: Path) -> set[str]:
    """Variable names set (or shown commented out) in an EnvironmentFile example."""
    names = set()
    for line in path.read_text().splitlines():
        m = re.match(r"^#?([A-Z][A-Z0-9_]*)=", line.strip())
        if m:
            names.add(m.group(1))
    return names


def config_class(section: str) -> type[ServerConfig]:
    """The config class of a TOML section: ``services.<pkg>.config.<Section>Config``."""
    pkg = {"engine": "rollout", "gateway": "rollout", "cell-daemon": "scheduler"}.get(section, section)
    module = importlib.import_module(f"services.{pkg}.config")
    cls = getattr(module, "".join(w.capitalize() for w in section.split("-")) + "Config")
    assert issubclass(cls, ServerConfig)
    return cls


def load_as_launched(spec: ServiceSpec, config: Path) -> ServerConfig:
    """The config the process would build from ``config`` plus the launcher's flags."""
    argv = launcher_argv(spec)
    assert argv[3] == "--config"
    return load_config(config_class(spec.section), path=config, section=spec.section, argv=argv[5:])


def grace_s(config: Path, spec: ServiceSpec) -> float:
    return float(load_as_launched(spec, config).grace_s)


def seconds(value: str) -> float:
    """'45', '45s', '2min', '1m30s' -> seconds (the forms systemd and compose use here)."""
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(min|ms|h|m|s)?", value):
        total += float(number) * {"": 1, "s": 1, "ms": 1e-3, "m": 60, "min": 60, "h": 3600}[unit]
    assert total > 0, f"cannot read a duration from {value!r}"
    return total


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def gyre_services() -> dict[str, dict[str, Any]]:
    return {k: v for k, v in compose()["services"].items() if k not in ("redis", "credentials")}


def env_fields(env: dict[str, str] | list[str]) -> list[tuple[str, str]]:
    """(section, field) of every GYRE_<SECTION>_<FIELD> variable."""
    names = list(env) if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]
    sections = "|".join(sorted((s.upper() for s in SECTIONS), key=len, reverse=True))
    out = []
    for name in names:
        m = re.match(rf"^GYRE_({sections})_(\w+)$", name)
        if m:
            out.append((m.group(1).lower(), m.group(2).lower()))
    return out


# -- systemd ------------------------------------------------------------------------------------
def unit_argv(unit: Path) -> list[str]:
    (exec_start,) = parse_unit(unit)["Service"]["ExecStart"]
    return shlex.split(exec_start)


def test_there_is_a_unit_for_every_launcher_command() -> None:
    covered = {(m, tuple(f)) for m, f in map(module_and_flags, map(unit_argv, UNITS))}
    missing = [f"{m} {list(f)}" for m, f in variants() if (m, f) not in covered]
    assert not missing, f"deploy/systemd has no unit running {missing}"


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_runs_the_launcher_command(unit: Path) -> None:
    argv = unit_argv(unit)
    spec = spec_for(argv, unit.name)
    assert flag_value(argv, "--config") == "/etc/gyre/gyre.toml"
    if "--cell-id" in argv and flag_value(argv, "--cell-id") == "%i":
        assert "@" in unit.name, "a unit that takes its cell id from the instance name is a template"
    if spec.module == "services.rollout.engine_main":
        assert "@" in unit.name and flag_value(argv, "--cell-id") == "%i", "one templated unit per engine cell"


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_restarts_and_outlasts_the_grace_period(unit: Path) -> None:
    service = parse_unit(unit)["Service"]
    assert service["Restart"] == ["on-failure"]
    assert service.get("KillSignal", ["SIGTERM"]) == ["SIGTERM"]
    # Drain/hand-off and then server.stop(grace_s) may each take grace_s before systemd's SIGKILL.
    grace = grace_s(DEPLOY / "config" / "systemd.toml", spec_for(unit_argv(unit), unit.name))
    assert seconds(service["TimeoutStopSec"][0]) > 2 * grace


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_variables_are_defined_in_its_environment_files(unit: Path) -> None:
    service = parse_unit(unit)["Service"]
    files = service["EnvironmentFile"]
    assert "/etc/gyre/gyre.env" in files
    defined = env_file_vars(DEPLOY / "systemd" / "gyre.env.example")
    if any("engine-%i.env" in f for f in files):
        defined |= env_file_vars(DEPLOY / "systemd" / "engine-cell.env.example")
    used = set(re.findall(r"\$\{(\w+)\}", service["ExecStart"][0]))
    assert used and used <= defined, f"{unit.name} uses {sorted(used - defined)} that no example env file sets"


def test_env_examples_name_real_config_fields() -> None:
    for path in (DEPLOY / "systemd").glob("*.env.example"):
        for section, field in env_fields(sorted(env_file_vars(path))):
            names = {f.name for f in dataclasses.fields(config_class(section))}
            assert field in names, f"{path.name}: GYRE_{section.upper()}_{field.upper()} is not a config field"


# -- docker compose -----------------------------------------------------------------------------
def compose_argv(name: str) -> list[str]:
    return [str(a) for a in gyre_services()[name]["command"]]


def test_compose_runs_every_launcher_command_and_two_engine_cells() -> None:
    services = gyre_services()
    specs = {name: spec_for(compose_argv(name), f"compose service {name}") for name in services}
    covered = {(m, tuple(f)) for m, f in (module_and_flags(launcher_argv(s)) for s in specs.values())}
    missing = [f"{m} {list(f)}" for m, f in variants() if (m, f) not in covered]
    assert not missing, f"docker-compose.yml has no service running {missing}"
    engines = [n for n, spec in specs.items() if spec.module == "services.rollout.engine_main"]
    assert len(engines) == 2
    assert len({s["image"] for s in services.values()}) == 1, "one image for every Gyre service"
    cells = [flag_value(compose_argv(e), "--cell-id") for e in engines]
    assert len(set(cells)) == 2
    (gateway,) = [n for n, spec in specs.items() if spec.module == "services.rollout.gateway_main"]
    registered = flag_value(compose_argv(gateway), "--engine-addresses").split(",")
    engine_port = load_as_launched(specs[engines[0]], DEPLOY / "config" / "compose.toml").port
    assert sorted(registered) == sorted(f"{c}={e}:{engine_port}" for c, e in zip(cells, engines))
    # every engine cell has its cell daemon pointing at it
    daemons = {flag_value(compose_argv(n), "--cell-id"): compose_argv(n) for n, spec in specs.items()
              if spec.module == "services.scheduler.daemon_main"}
    for cell, engine in zip(cells, engines):
        assert flag_value(daemons[cell], "--engine-address") == f"{engine}:{engine_port}"


@pytest.mark.parametrize("name", sorted(gyre_services()))
def test_compose_service_runs_the_launcher_command(name: str) -> None:
    svc = gyre_services()[name]
    argv = compose_argv(name)
    spec_for(argv, f"compose service {name}")
    config_in_container = flag_value(argv, "--config")
    mounts = [v.split(":") for v in svc["volumes"]]
    assert ["./config/compose.toml", config_in_container, "ro"] in mounts, "the config file must be mounted"


@pytest.mark.parametrize("name", sorted(gyre_services()))
def test_compose_healthcheck_probes_the_services_own_port(name: str) -> None:
    svc = gyre_services()[name]
    spec = spec_for(compose_argv(name), name)
    compose_toml = DEPLOY / "config" / "compose.toml"
    cfg = load_as_launched(spec, compose_toml)
    assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "services.common.healthcheck",
                                          f"127.0.0.1:{cfg.port}"]
    assert seconds(svc["stop_grace_period"]) > 2 * cfg.grace_s
    assert svc["restart"] in ("on-failure", "unless-stopped", "always")
    for section, field in env_fields(svc.get("environment", {})):
        assert field in {f.name for f in dataclasses.fields(config_class(section))}


def test_compose_redis_keeps_an_append_only_file_on_a_volume() -> None:
    spec = compose()
    redis = spec["services"]["redis"]
    command = [str(c) for c in redis["command"]]
    assert flag_value(command, "--appendonly") == "yes"
    data_dir = flag_value(command, "--dir")
    volume, target = redis["volumes"][0].split(":")[:2]
    assert target == data_dir and volume in spec["volumes"], "AOF must live on a named volume"
    for name, svc in gyre_services().items():
        assert flag_value([str(a) for a in svc["command"]], "--redis-url").startswith("redis://redis:"), name


# -- shipped configs ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_sections_are_known(path: Path) -> None:
    data = tomllib.loads(path.read_text())
    unknown = set(data) - {*OTHER_SECTIONS, *SECTIONS}
    assert not unknown, f"{path.name}: unknown sections {sorted(unknown)}"


@pytest.mark.parametrize("path", [p for p in CONFIGS if "harness" in tomllib.loads(p.read_text())],
                         ids=lambda p: p.name)
def test_a_shipped_harness_section_parses_into_the_harness_config(path: Path) -> None:
    from services.harness.config import HarnessConfig

    table = tomllib.loads(path.read_text())["harness"]
    cfg = load_config(HarnessConfig, path=path, section="harness")
    assert {k: getattr(cfg, k) for k in table} == table


@pytest.mark.parametrize("spec", list(variants().values()), ids=lambda s: s.name)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses_into_the_services_config(path: Path, spec: ServiceSpec) -> None:
    cfg = load_as_launched(spec, path)
    assert isinstance(cfg, config_class(spec.section))
    if path.name in DEPLOYMENTS:  # deployments bind every interface, on fixed ports but per-cell ones
        assert cfg.host == "0.0.0.0"
        assert cfg.port > 0 or spec.section in ("engine", "cell-daemon") and path.name == "systemd.toml"


def test_a_typo_in_a_shipped_config_would_be_caught(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((DEPLOY / "config" / "compose.toml").read_text().replace("token_budget", "token_budgte"))
    with pytest.raises(ValueError, match="unknown field 'token_budgte'"):
        load_config(config_class("trajectory"), path=bad, section="trajectory")


def test_units_keep_the_redis_url_off_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis URL holds its password: units name the variable (``env:REDIS_URL``), which each
    service resolves at start; a missing variable is a clear config error."""
    from services.common.config import ServerConfig

    for unit in UNITS:
        argv = unit_argv(unit) if "--redis-url" in parse_unit(unit)["Service"]["ExecStart"][0] else None
        if argv is not None:
            assert flag_value(argv, "--redis-url") == "env:REDIS_URL", unit.name
    monkeypatch.setenv("REDIS_URL", "redis://:s3cret@10.0.0.1:6379/0")
    assert ServerConfig(redis_url="env:REDIS_URL").redis_url == "redis://:s3cret@10.0.0.1:6379/0"
    monkeypatch.delenv("REDIS_URL")
    with pytest.raises(ValueError, match="REDIS_URL that is set"):
        ServerConfig(redis_url="env:REDIS_URL")


def test_compose_makes_credentials_once_and_every_service_uses_them(tmp_path: Path) -> None:
    spec = compose()
    cred = spec["services"]["credentials"]
    assert cred["command"][:4] == ["python", "-m", "services.cli", "credentials"]
    for name, svc in gyre_services().items():
        assert any(str(v).startswith("credentials:") for v in svc["volumes"]), name
        env = svc.get("environment", {})
        section = name.split("-")[0].replace("cell", "cell_daemon").upper()
        tokens = env.get(f"GYRE_{section}_AUTH_TOKENS_FILE")
        assert tokens == "/var/lib/gyre/credentials/tokens", (name, sorted(env))
        # TLS by default: every service serves the node certificate and trusts the deployment's CA
        assert env.get(f"GYRE_{section}_TLS_CERT_FILE") == "/var/lib/gyre/credentials/node.pem", name
        assert env.get(f"GYRE_{section}_TLS_KEY_FILE") == "/var/lib/gyre/credentials/node.key", name
        assert env.get(f"GYRE_{section}_TLS_CA_FILE") == "/var/lib/gyre/credentials/ca.pem", name
        assert env.get("GYRE_TLS_CA_FILE") == "/var/lib/gyre/credentials/ca.pem", name  # its health probe
    # what that service runs: every role's token once, the KV key, mode 0640; --keep keeps them
    import subprocess
    import sys

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.cli", "credentials", str(tmp_path / "c"), *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    assert run().returncode == 0
    lines = [line.split() for line in (tmp_path / "c" / "tokens").read_text().splitlines() if not line.startswith("#")]
    assert sorted(r for r, _ in lines) == ["harness", "internal", "operator"] and len({t for _, t in lines}) == 3
    assert all(((tmp_path / "c" / f).stat().st_mode & 0o777) == 0o640 for f in ("tokens", "kv.key", "harness.token"))
    before = (tmp_path / "c" / "tokens").read_text()
    assert run("--keep").returncode == 0 and (tmp_path / "c" / "tokens").read_text() == before
    assert run().returncode == 2  # never overwritten by accident
    from services.common.security import read_tokens

    assert len(read_tokens(str(tmp_path / "c" / "tokens"))) == 3


def test_credentials_make_a_ca_and_a_node_certificate_for_every_host_clients_dial(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "c"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "credentials", str(out), "--host", "10.0.0.7",
                           "--host", "gyre-ctl.internal"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "ca.key").stat().st_mode & 0o777 == 0o600  # signs certificates: its owner only
    assert all((out / f).stat().st_mode & 0o777 == 0o640 for f in ("ca.pem", "node.pem", "node.key"))
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.pem"), str(out / "node.pem")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", str(out / "node.pem"), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout
    for name in ("DNS:localhost", "IP Address:127.0.0.1", "IP Address:10.0.0.7", "DNS:gyre-ctl.internal",
                 *(f"DNS:{n}" for n in gyre_services())):  # every compose service a peer dials by name
        assert name in text, (name, text)
    assert "node.key" not in proc.stdout or "BEGIN" not in proc.stdout  # paths printed, never a key
    # a host that is no name: one sentence, nothing written
    bad = subprocess.run([sys.executable, "-m", "services.cli", "credentials", str(tmp_path / "d"), "--host", "a b"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "neither an IP address nor a DNS name" in bad.stderr
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
