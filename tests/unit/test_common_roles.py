"""The three kinds of role, one definition each, equal to the wire's."""

from __future__ import annotations

import pytest

from protos.gyre.v1 import common_pb2
from services.common.roles import AGENT_ROLES, AUTH_ROLES, AgentRole, CellRole


def test_agent_roles_match_the_wire_and_their_names() -> None:
    assert [r.value for r in AgentRole] == [common_pb2.ROLE_MAIN, common_pb2.ROLE_SUBAGENT, common_pb2.ROLE_SUMMARY]
    assert tuple(r.label for r in AgentRole) == AGENT_ROLES == ("main", "subagent", "summary")
    assert common_pb2.AgentRole.Name(AgentRole.SUBAGENT) == "ROLE_SUBAGENT"


@pytest.mark.parametrize("value, role", [("main", AgentRole.MAIN), ("ROLE_SUBAGENT", AgentRole.SUBAGENT),
                                         ("sub-agent", AgentRole.SUBAGENT), (" Summary ", AgentRole.SUMMARY),
                                         (3, AgentRole.SUMMARY), (AgentRole.MAIN, AgentRole.MAIN)])
def test_agent_role_parse(value: object, role: AgentRole) -> None:
    assert AgentRole.parse(value) is role


@pytest.mark.parametrize("value", ["boss", 0, 4, True, None, 1.0])
def test_agent_role_parse_refuses_in_one_sentence(value: object) -> None:
    with pytest.raises(ValueError, match=r"expected main, subagent or summary"):
        AgentRole.parse(value)


def test_cell_roles_cover_the_wire() -> None:
    wire = {n.removeprefix("CELL_ROLE_").lower() for n in common_pb2.CellRole.keys()} - {"unspecified"}
    assert {r.value for r in CellRole} == wire


def test_auth_roles() -> None:
    assert AUTH_ROLES == ("internal", "harness", "operator")
