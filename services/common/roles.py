"""Gyre's three kinds of role, one name each (docs/glossary.md).

- `AgentRole`: who in an execution made a model call: the main agent, a sub-agent, or a
  compaction's summarizer. TITO records carry it, the trajectory service picks paths by it (lower
  value wins), session URLs name it. On the wire: ``gyre.v1.AgentRole``.
- `CellRole`: what a cell runs now: rollout, train, switching between them, or idle (registered, not
  yet assigned). The scheduler's policy moves cells between roles. On the wire: ``gyre.v1.CellRole``.
- `AuthRole`: what a credential may call: ``internal`` (the services), ``harness`` or ``operator``.

A chat message's role (system, user, assistant, tool) is the HTTP APIs' own word; it stays inside
their translations (services/rollout/chat.py and the *_http.py modules).
"""

from __future__ import annotations

import enum
from typing import Any, Literal

__all__ = ["AgentRole", "AgentRoleName", "AGENT_ROLES", "CellRole", "AuthRole", "AUTH_ROLES"]


class AgentRole(enum.IntEnum):
    """Who made a model call; the value is the path-selection priority (lower wins) and equals
    gyre.v1.AgentRole's."""

    MAIN = 1
    SUBAGENT = 2
    SUMMARY = 3

    @property
    def label(self) -> AgentRoleName:
        """Its name in records, traces and session URLs: main, subagent or summary."""
        return self.name.lower()  # type: ignore[return-value]

    @classmethod
    def parse(cls, value: Any) -> AgentRole:
        """From a role, its number, or a name (``main``, ``ROLE_SUBAGENT``, ``sub-agent``, ...)."""
        if isinstance(value, AgentRole):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str):
            name = value.strip().upper().removeprefix("ROLE_").replace("-", "").replace("_", "")
            if name in cls.__members__:
                return cls[name]
        raise ValueError(f"role {value!r} is unknown; expected {', '.join(AGENT_ROLES[:-1])} or {AGENT_ROLES[-1]}")


AgentRoleName = Literal["main", "subagent", "summary"]
"""An agent role by name, as the agents, records and session URLs write it."""

AGENT_ROLES: tuple[AgentRoleName, ...] = ("main", "subagent", "summary")
"""Every agent role's name, in priority order (`AgentRole.label`)."""


class CellRole(str, enum.Enum):
    """What a cell runs now (IDLE: registered, not yet assigned)."""

    ROLLOUT = "rollout"
    TRAIN = "train"
    SWITCHING = "switching"
    IDLE = "idle"


AuthRole = Literal["internal", "harness", "operator"]
"""What a credential may call (services/common/security.py)."""

AUTH_ROLES: tuple[AuthRole, ...] = ("internal", "harness", "operator")
"""Every credential role."""
