"""Typed, validated configuration for every Gyre service.

A service config is a frozen, keyword-only dataclass whose fields are declared with ``setting``
(default + one-line doc, units in the name). Values come, in increasing precedence, from the
defaults, a TOML file section, environment variables (``GYRE_<SVC>_<FIELD>``) and ``--field value``
command-line flags. Every source is type-checked; a bad value raises ``ValueError`` with one
sentence naming the field, its source and what was expected.

    cfg = load_config(TrajectoryConfig, path="deploy/config/local.toml", section="trajectory",
                      env_prefix="GYRE_TRAJECTORY_", argv=sys.argv[1:])
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def setting(default: Any, doc: str) -> Any:
    """A config field with a default and a docstring (shown by ``--help``)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in configs; use a tuple")
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Fields every gRPC service has."""

    host: str = setting("127.0.0.1", "Interface the gRPC server binds.")
    port: int = setting(0, "gRPC port; 0 picks a free port (printed at start).")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding queues, registry and indexes; "
                                                         "env:NAME reads it from that environment variable "
                                                         "(a URL with a password stays off argv).")
    spool_dir: str = setting(".gyre/spool", "Blob spool directory for large payloads.")
    metrics_port: int = setting(-1, "Prometheus /metrics port; 0 = any free port, -1 = disabled.")
    log_json: bool = setting(True, "Log one JSON object per line (else a console format).")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR.")
    grace_s: float = setting(10.0, "Graceful-shutdown grace period for in-flight RPCs, seconds.")
    max_message_mb: int = setting(256, "Largest gRPC message accepted or sent, MiB.")
    max_workers: int = setting(64, "Threads serving RPCs (one per concurrent stream).")
    tls_cert_file: str = setting("", "PEM certificate this server presents (TLS on when set).")
    tls_key_file: str = setting("", "PEM private key of tls_cert_file.")
    tls_client_ca_file: str = setting("", "CA whose client certificates are required (mTLS) when set.")
    tls_ca_file: str = setting("", "CA this process trusts when it calls other services over TLS.")
    auth_token: str = setting("", "Bearer token callers must present (and this process sends); empty = off. "
                                  "Prefer auth_token_file / auth_tokens_file: a value here shows in argv.")
    auth_token_file: str = setting("", "File holding auth_token (what this process sends; without "
                                       "auth_tokens_file also the one token accepted).")
    auth_tokens_file: str = setting("", "Per-role tokens this server accepts, 'ROLE TOKEN' per line (roles: "
                                        "internal, harness, operator); it sends its first internal token.")

    def __post_init__(self) -> None:
        if self.redis_url.startswith("env:"):
            name = self.redis_url.removeprefix("env:")
            value = os.environ.get(name, "")
            check(bool(value), "redis_url", self.redis_url, f"an environment variable {name} that is set")
            object.__setattr__(self, "redis_url", value)
        check(0 <= self.port < 65536, "port", self.port, "an integer in [0, 65535]")
        check(-1 <= self.metrics_port < 65536, "metrics_port", self.metrics_port, "-1, 0 or a port")
        check(self.redis_url.startswith(("redis://", "rediss://", "unix://")), "redis_url",
              self.redis_url, "a redis://, rediss:// or unix:// URL")
        check(self.grace_s >= 0, "grace_s", self.grace_s, "a non-negative number of seconds")
        check(1 <= self.max_message_mb <= 2047, "max_message_mb", self.max_message_mb,
              "between 1 and 2047 MiB")
        check(self.max_workers >= 1, "max_workers", self.max_workers, "at least 1")
        check(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
              self.log_level, "DEBUG, INFO, WARNING or ERROR")


def check(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise the one-sentence ValueError configs use when ``ok`` is false."""
    if not ok:
        raise ValueError(f"config field '{name}' is {value!r}; expected {expected}")


def fields_doc(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type name, default, doc) for each field of a config class, for ``--help``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        out.append((f.name, _type_name(hints[f.name]), f.default, f.metadata.get("doc", "")))
    return out


def load_config(
    cls: type[T],
    *,
    path: str | os.PathLike[str] | None = None,
    section: str | None = None,
    env_prefix: str | None = None,
    argv: Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from defaults < TOML ``[section]`` < env ``{env_prefix}FIELD`` < argv < overrides."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass config")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}

    if path is not None:
        values.update(_from_toml(Path(path), section, names, hints))
    if env_prefix:
        for name in names:
            raw = os.environ.get(env_prefix + name.upper())
            if raw is not None:
                values[name] = _coerce(raw, hints[name], name, f"env {env_prefix + name.upper()}")
    if argv:
        values.update(_from_argv(argv, names, hints))
    if overrides:
        for name, value in overrides.items():
            if name not in names:
                raise ValueError(f"unknown config field '{name}'; known: {', '.join(sorted(names))}")
            values[name] = _typed(value, hints[name], name, "overrides")
    return cls(**values)  # type: ignore[return-value]  # cls is a dataclass type T


def _from_toml(path: Path, section: str | None, names: set[str], hints: dict[str, Any]) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    table: Any = data
    if section:
        table = data.get(section, {})
        shared = data.get("common", {})
        table = {**{k: v for k, v in shared.items() if k in names}, **table}
    if not isinstance(table, dict):
        raise ValueError(f"config file {str(path)!r}: [{section}] must be a table")
    out = {}
    for key, value in table.items():
        if key not in names:
            raise ValueError(
                f"config file {str(path)!r}: unknown field '{key}' in [{section or 'root'}]; "
                f"known: {', '.join(sorted(names))}"
            )
        out[key] = _typed(value, hints[key], key, str(path))
    return out


def _from_argv(argv: Sequence[str], names: set[str], hints: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; flags look like --field value")
        key, eq, inline = arg[2:].partition("=")
        name = key.replace("-", "_")
        if name not in names:
            raise ValueError(f"unknown flag --{key}; known: " + ", ".join("--" + n.replace('_', '-') for n in sorted(names)))
        if eq:
            raw = inline
        elif _base(hints[name]) is bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            raw = "true"
        else:
            if i + 1 >= len(argv):
                raise ValueError(f"flag --{key} needs a value")
            i += 1
            raw = argv[i]
        out[name] = _coerce(raw, hints[name], name, f"flag --{key}")
        i += 1
    return out


def _base(tp: Any) -> Any:
    """Strip ``X | None`` to ``X``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(raw: str, tp: Any, name: str, source: str) -> Any:
    """Parse a string (env var or flag) into the field's type."""
    optional = _base(tp) is not tp
    base = _base(tp)
    if optional and raw.lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
        if base in (str, Path):
            return base(raw)
        if typing.get_origin(base) is tuple:
            (inner, *_rest) = typing.get_args(base)
            return tuple(_coerce(p.strip(), inner, name, source) for p in raw.split(",") if p.strip())
        if isinstance(base, type) and issubclass(base, str):  # str enums
            return base(raw)
    except ValueError:
        pass
    else:
        raise ValueError(f"config field '{name}' from {source}: unsupported type {_type_name(tp)}")
    raise ValueError(f"config field '{name}' from {source} is {raw!r}; expected {_type_name(base)}")


def _typed(value: Any, tp: Any, name: str, source: str) -> Any:
    """Check a TOML/override value against the field's type (ints accepted for floats)."""
    base = _base(tp)
    if value is None and base is not tp:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(base) is tuple and isinstance(value, (list, tuple)):
        (inner, *_rest) = typing.get_args(base)
        return tuple(_typed(v, inner, name, source) for v in value)
    if base is Path and isinstance(value, str):
        return Path(value)
    if isinstance(base, type) and issubclass(base, str) and base is not str and isinstance(value, str):
        try:
            return base(value)
        except ValueError:
            pass
    if isinstance(base, type) and isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise ValueError(
        f"config field '{name}' from {source} is {value!r} ({type(value).__name__}); expected {_type_name(base)}"
    )
