"""Config of the reward service: TOML section ``[reward]``, env ``GYRE_REWARD_<FIELD>``, or
``--field value`` flags (see ``services.common.config``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ServerConfig, check, setting
from services.reward.sandbox import SANDBOXES, SandboxSpec
from services.reward.scorers import Allowlist, ScorerSpec
from services.reward.service import TIMEOUT_POLICIES
from services.reward.workspace import WorkspaceLimits


@dataclass(frozen=True, kw_only=True)
class RewardConfig(ServerConfig):
    """The reward service (workspaces -> scores -> execution outcomes)."""

    trajectory_address: str = setting("", "host:port of the trajectory service outcomes are reported to; "
                                          "empty = do not report.")
    default_scorer: str = setting("builtin:xlong-v1", "Scorer of jobs that configured none: builtin:NAME, "
                                                      "entry_point:module:function or external:host:port.")
    default_timeout_policy: str = setting("partial", "Timeout policy of jobs that set none: partial, zero "
                                                     "or exclude.")
    scorer_timeout_s: float = setting(30.0, "Time limit of one scoring, seconds (a job's scorer may set its own).")
    scorer_workers: int = setting(2, "Sandbox worker processes, i.e. concurrent scorings.")
    scorer_memory_mb: int = setting(1024, "Address-space cap of one sandbox worker, MiB.")
    scorer_allowlist: tuple[str, ...] = setting((), "Scorers a job may pick besides the builtins and default_scorer: "
                                                    "entry_point:module:function, entry_point:module:* or "
                                                    "external:host:port.")
    scorer_sandbox: str = setting("bwrap", "How scorer workers are confined: bwrap (bubblewrap: no network, own "
                                           "PID namespace, read-only system, tmpfs workspace) or none (only limits "
                                           "and a clean environment; logged as a warning).")
    scorer_paths: tuple[str, ...] = setting((), "Extra read-only paths in the sandbox, importable (PYTHONPATH): "
                                                "where allowlisted entry-point scorers live.")
    scorer_env: tuple[str, ...] = setting((), "Names of environment variables scorers may see (none by default).")
    scorer_max_procs: int = setting(64, "Processes (and threads) of one sandbox worker's user.")
    scorer_max_open_files: int = setting(256, "Open files of one scoring.")
    scorer_max_file_mb: int = setting(64, "Largest file a scoring may write, MiB.")
    scorer_scratch_mb: int = setting(256, "Size of the sandbox's /ws (workspace) and /tmp tmpfs, MiB each.")
    scorer_uid_base: int = setting(61000, "When the service runs as root: worker k runs as uid base + k % 1000 "
                                          "(unprivileged, one per worker).")
    external_scorer_token_file: str = setting("", "File holding the bearer token sent to external scorers (their "
                                                  "own credential; the service's own token is never sent).")
    external_scorer_ca_file: str = setting("", "CA (PEM) that external scorers' TLS certificates are checked "
                                               "against; empty = plaintext.")
    max_files: int = setting(1024, "Files in one workspace snapshot.")
    max_file_bytes: int = setting(1 << 20, "Bytes in one workspace file.")
    max_total_bytes: int = setting(16 << 20, "Bytes in one workspace snapshot (all files, uncompressed).")
    max_path_chars: int = setting(256, "Characters in one workspace path.")
    retention_s: int = setting(7 * 24 * 3600, "How long workspace references, scores and job policies stay "
                                              "in Redis, seconds.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.default_timeout_policy in TIMEOUT_POLICIES, "default_timeout_policy",
              self.default_timeout_policy, "partial, zero or exclude")
        check(0 < self.scorer_timeout_s <= 3600, "scorer_timeout_s", self.scorer_timeout_s, "in (0, 3600] seconds")
        check(1 <= self.scorer_workers <= 64, "scorer_workers", self.scorer_workers, "between 1 and 64")
        check(self.scorer_memory_mb >= 128, "scorer_memory_mb", self.scorer_memory_mb, "at least 128 MiB")
        check(self.retention_s >= 60, "retention_s", self.retention_s, "at least 60 seconds")
        check(self.scorer_sandbox in SANDBOXES, "scorer_sandbox", self.scorer_sandbox, " or ".join(SANDBOXES))
        check(1 <= self.scorer_max_procs <= 4096, "scorer_max_procs", self.scorer_max_procs, "between 1 and 4096")
        check(16 <= self.scorer_max_open_files <= 65536, "scorer_max_open_files", self.scorer_max_open_files,
              "between 16 and 65536")
        check(1 <= self.scorer_max_file_mb <= 65536, "scorer_max_file_mb", self.scorer_max_file_mb, ">= 1 MiB")
        check(1 <= self.scorer_scratch_mb <= 65536, "scorer_scratch_mb", self.scorer_scratch_mb, ">= 1 MiB")
        check(1000 <= self.scorer_uid_base <= 4_000_000_000, "scorer_uid_base", self.scorer_uid_base,
              "an unprivileged uid (>= 1000)")
        for path in self.scorer_paths:
            check(path.startswith("/"), "scorer_paths", path, "absolute paths")
        try:
            self.allowlist
            self.sandbox
        except ValueError as exc:
            raise ValueError(f"config: {exc}") from None
        try:
            self.limits
        except ValueError as exc:
            raise ValueError(f"config: workspace limits are invalid: {exc}") from None
        try:
            self.scorer_spec
        except ValueError as exc:
            raise ValueError(f"config field 'default_scorer' is {self.default_scorer!r}; {exc}") from None

    @property
    def limits(self) -> WorkspaceLimits:
        return WorkspaceLimits(max_files=self.max_files, max_file_bytes=self.max_file_bytes,
                               max_total_bytes=self.max_total_bytes, max_path_chars=self.max_path_chars)

    @property
    def allowlist(self) -> Allowlist:
        return Allowlist(tuple(self.scorer_allowlist), self.default_scorer)

    @property
    def sandbox(self) -> SandboxSpec:
        return SandboxSpec(sandbox=self.scorer_sandbox, memory_mb=self.scorer_memory_mb,
                           max_procs=self.scorer_max_procs, max_open_files=self.scorer_max_open_files,
                           max_file_mb=self.scorer_max_file_mb, scratch_mb=self.scorer_scratch_mb,
                           uid_base=self.scorer_uid_base, paths=tuple(self.scorer_paths), env=tuple(self.scorer_env))

    @property
    def scorer_spec(self) -> ScorerSpec:
        return parse_scorer(self.default_scorer)


def parse_scorer(text: str) -> ScorerSpec:
    """``builtin:xlong-v1`` / ``entry_point:pkg.mod:fn`` / ``external:host:port`` -> ScorerSpec."""
    kind, sep, target = text.partition(":")
    if not sep or kind not in ("builtin", "entry_point", "external"):
        raise ValueError("expected builtin:NAME, entry_point:module:function or external:host:port")
    return ScorerSpec(kind=kind, target=target)  # type: ignore[arg-type]
